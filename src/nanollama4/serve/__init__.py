"""`nanollama4 serve`: the model behind an OpenAI-compatible HTTP API, with a page that shows each
streamed token's route.

  engine.py  continuous batching: the slot KV cache and the loop that decodes all requests together
  schema.py  the request bodies (their sampling fields read from `Sampling`), checked into `Params`,
             and the API's error object
  reply.py   the answers in each endpoint's shape: whole responses, streamed chunks, logprobs, usage
  api.py     the HTTP side: the routes, health, the engine's events onto the event loop, the page at /
             (Starlette on uvicorn)
  page.html  the page: one self-contained file, no network but this server
  chat.py    chat messages to one prompt: our play format, or a checkpoint's own template
  template_worker.py  the process that renders such a template: a Jinja sandbox under a memory ceiling
  guard.py   who may use the server (Host, Origin, content type) and how long a connection may wait
  logs.py    the server's log, one printable line per event whatever a client wrote
  server.py  the process: bind, run uvicorn over the app, stop cleanly on SIGTERM
"""
