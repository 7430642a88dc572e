"""The OpenAI-compatible server around the offloaded engine (needs the ``serve`` extra): app.py (FastAPI
endpoints, hostile input, the drain), protocol.py (the requests), responses.py (the answers), metrics.py
(/metrics), running.py (uvicorn in the foreground or a thread).

    engine = moe_offload.load("tiny", fast_budget="30%", policy="lcp", prefetch="moepic", max_batch=16)
    from moe_offload.server import serve
    serve(engine, "tiny", port=8000)         # until Ctrl-C / SIGTERM; or ServerThread(engine, "tiny") in-process
"""

from moe_offload.server.app import create_app, model_name
from moe_offload.server.running import ServerThread, serve

__all__ = ["ServerThread", "create_app", "model_name", "serve"]
