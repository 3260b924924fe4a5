"""Pure translation between the client's Responses API and the upstream's function-tool dialect.

Nothing here performs I/O, awaits, reads a clock or logs; every function is driven by its inputs. What needs the
time, a fresh id or random bytes takes them as arguments (``gateway.protocol.ids``; the real ones are in
``gateway.runtime``): ``.importlinter`` forbids the modules that would do otherwise, and mypy checks the package
strictly.
"""
