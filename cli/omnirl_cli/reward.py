"""``omnirl reward serve NAME``: serve an installed reward over HTTP for the ``remote`` reward."""

from __future__ import annotations

import signal
import sys

import typer

SetOpt = typer.Option(None, "--set", help="A reward option, e.g. --set preset=tiny --set device=cuda:1 (repeatable).")
reward_app = typer.Typer(help="Work with one reward: serve it over HTTP.", no_args_is_help=True)


@reward_app.command("serve")
def serve(
    name: str = typer.Argument(..., help="An installed reward (see `omnirl list rewards`)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8700, "--port", "-p", help="Port to listen on (0: a free one, printed)."),
    overrides: list[str] | None = SetOpt,
    max_batch: int = typer.Option(32, "--max-batch", min=1, help="Most samples scored in one call."),
    max_wait_ms: float = typer.Option(5.0, "--max-wait-ms", min=0, help="How long the first request of a "
                                      "batch waits for others to join it."),
    max_body_mb: float = typer.Option(1024.0, "--max-body-mb", min=0.001, help="Largest request body, and the "
                                      "most request bytes held at once (requests past it wait), in MiB. 1024 "
                                      "fits 64 float32 images of 1024x1024."),
    idle_timeout_s: float = typer.Option(60.0, "--idle-timeout-s", min=0.001, help="A kept-alive connection "
                                         "silent this long after an answer is closed; a body that stalls this "
                                         "long is answered 408."),
    max_connections: int = typer.Option(64, "--max-connections", min=1, help="Connections open at once; a "
                                        "request on one more is answered 503 and its connection closed."),
) -> None:
    """Serve reward NAME: POST /score (a safetensors body: the outputs' exact tensors), GET /health. The reward
    is called as in process (the same tensors, each request's batch; concurrent requests share a call only for
    a batch-invariant reward). Set OMNIRL_REWARD_SERVER_TOKEN to require a bearer token. The HTTP server is
    uvicorn; SIGINT / SIGTERM stop it gracefully (the requests in flight are answered first)."""
    from omnirl_core.config import parse_set
    from omnirl_core.rewards.server import RewardServer
    from omnirl_core.rewards_kit import build_reward

    reward, spec = build_reward(name, parse_set(overrides or []))
    server = RewardServer(reward, spec.name, spec.modalities, host=host, port=port, max_batch=max_batch,
                          max_wait_ms=max_wait_ms, max_body_bytes=int(max_body_mb * (1 << 20)),
                          idle_timeout_s=idle_timeout_s, max_connections=max_connections)

    def stop(signum, frame):
        raise KeyboardInterrupt

    # uvicorn stops gracefully on SIGINT / SIGTERM, then raises the signal again: both end here
    signal.signal(signal.SIGTERM, stop)
    print(f"omnirl: serving reward '{spec.name}' on {server.url} (POST /score, GET /health)", file=sys.stderr,
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    print("omnirl: reward server stopped", file=sys.stderr, flush=True)


def register(app: typer.Typer) -> None:
    app.add_typer(reward_app, name="reward")
