"""Accept/reject oracle over xgrammar, run in the tiny vLLM's environment (which has xgrammar and torch; the
gateway's own environment never imports them). Reads JSON on stdin:

    {"jobs": [{"ebnf": "<grammar>"} | {"regex": "<pattern>"} | {"json_schema": {...}} | {"structural_tag": {...}},
               "strings": [...]}, ...]}

and writes {"results": [[true, false, ...], ...]} (one list per job) or {"error": "..."} for a grammar that
xgrammar refuses. A string is accepted when the matcher takes all of it and can terminate there.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import xgrammar as xgr

    request = json.load(sys.stdin)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)
    results = []
    for job in request["jobs"]:
        try:
            if "ebnf" in job:
                grammar = xgr.Grammar.from_ebnf(job["ebnf"])
            elif "regex" in job:
                grammar = xgr.Grammar.from_regex(job["regex"])
            elif "structural_tag" in job:
                grammar = xgr.Grammar.from_structural_tag(json.dumps(job["structural_tag"]))
            else:  # as vLLM's strict-tool structural tag builds it: no whitespace freedom
                grammar = xgr.Grammar.from_json_schema(json.dumps(job["json_schema"]), any_whitespace=False)
            compiled = compiler.compile_grammar(grammar)
        except Exception as exc:  # the grammar itself is the finding
            results.append({"error": f"{type(exc).__name__}: {exc}"[:2000]})
            continue
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        verdicts = []
        for text in job["strings"]:
            matcher.reset()
            verdicts.append(bool(matcher.accept_string(text)) and bool(matcher.is_terminated()))
        results.append(verdicts)
    json.dump({"results": results}, sys.stdout)


if __name__ == "__main__":
    main()
