"""Pure translation between the client's Responses API and the upstream's function-tool dialect.

Nothing here performs I/O, awaits, reads a clock or logs; every function is driven by its inputs.
"""
