"""The OpenAI-compatible HTTP server on FastAPI + uvicorn.

One concept per file: `protocol.py` the request and response bodies (pydantic, OpenAI's names),
`engine_request.py` a validated request turned into prompt ids and SamplingParams,
`chat_template.py` chats (tools and tool calls included) rendered to text, `tool_calls.py` GLM's
tool calls read back into OpenAI's, `engine_client.py` the server's view of the engine loop,
`serving.py` the completion endpoints (JSON and SSE, n choices each), `metrics.py` /metrics,
`auth.py` the API key, `errors.py` OpenAI's error bodies, `app.py` the routes (tokenize,
detokenize, version, the request id), `server.py` uvicorn and its limits.
"""
