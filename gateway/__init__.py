"""responses-gateway: an OpenAI Responses API gateway in front of vLLM."""
