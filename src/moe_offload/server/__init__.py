"""The OpenAI-compatible server around the offloaded engine (needs the ``serve`` extra): app.py (FastAPI
endpoints), protocol.py (the wire format), metrics.py (/metrics).

    engine = moe_offload.load("tiny", fast_budget="30%", policy="lcp", prefetch="moepic", max_batch=16)
    from moe_offload.server import serve
    serve(engine, "tiny", port=8000)         # until Ctrl-C / SIGTERM; or ServerThread(engine, "tiny") in-process
"""

from moe_offload.server.app import ServerThread, create_app, model_name, serve

__all__ = ["ServerThread", "create_app", "model_name", "serve"]
