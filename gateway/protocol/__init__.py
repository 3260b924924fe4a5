"""Wire types and SSE framing. No I/O, no clock."""
