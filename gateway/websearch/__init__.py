"""Web search run by the gateway (issue 21): providers (``providers.py``) behind one small interface (``base.py``)."""
