"""`nanollama4 serve`: the model behind an OpenAI-compatible HTTP API, with a page that shows each
streamed token's route.

  engine.py  continuous batching: the slot KV cache and the loop that decodes all requests together
  api.py     the HTTP side: the OpenAI request fields checked, the responses and server-sent events,
             the page at /, health and shutdown (Starlette on uvicorn)
  page.html  the page: one self-contained file, no network but this server
"""
