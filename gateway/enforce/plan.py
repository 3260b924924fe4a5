"""The enforcement plan for a request (pure policy): which tools are pinned by ``tool_choice``, which calls are
grammar calls to check or take over, and the failed response a violation gives. The engine runs the plan
(gateway.engine.enforcer, gateway.engine.takeover)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import StreamFailure
from gateway.translate.tool_context import ResolvedToolContext, ToolInfo

__all__ = ["VIOLATION", "Plan", "Violation", "plan_for", "violation_response"]

VIOLATION = "tool_choice_violation"


@dataclass(frozen=True, slots=True)
class Plan:
    mode: str
    pinned: tuple[ToolInfo, ...] = ()
    grammar_tools: tuple[ToolInfo, ...] = ()

    @property
    def constrain(self) -> bool:
        return self.mode == "constrain" and bool(self.pinned)

    @property
    def check_pinned(self) -> bool:
        return self.mode != "off" and bool(self.pinned)

    @property
    def check_grammar(self) -> bool:
        return self.mode != "off" and not self.pinned and bool(self.grammar_tools)

    @property
    def regenerate(self) -> bool:
        return self.mode == "constrain" and self.check_grammar

    @property
    def active(self) -> bool:
        return self.check_pinned or self.check_grammar


def plan_for(ctx: ResolvedToolContext, mode: str) -> Plan:
    if mode == "off":
        return Plan(mode)
    allowed = ctx.allowed_upstream_names
    offered = [i for i in ctx.callable_tools if allowed is None or i.upstream_name in allowed]
    # tool_choice none: no tool is offered upstream (rewrite.py), so nothing to check.
    grammar = () if ctx.upstream_tool_choice == "none" else tuple(i for i in offered if i.grammar is not None)
    return Plan(mode, ctx.pinned_tools, grammar)


class Violation(StreamFailure):
    """No call satisfying ``tool_choice`` could be made: the response fails with ``tool_choice_violation``."""

    code = VIOLATION


def violation_response(final: dict[str, Any], message: str) -> dict[str, Any]:
    """The client's failed response: what came back stays in ``output``; the error says why it failed."""
    out = dict(final)
    out["status"] = "failed"
    out["error"] = {"code": VIOLATION, "message": message}
    return out
