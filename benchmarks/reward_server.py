"""The reward server (``omnirl reward serve``): request throughput and large-body MB/s, server against server.

    python benchmarks/reward_server.py [--old PATH] [--rounds 3] [--clients 8] [--requests 400] [--large-mib 48]

Each server runs in a process of its own (as ``omnirl reward serve`` does), serving a trivial reward (the
number of elements of each output), so what is timed is the server: HTTP, the wire format and the hand-off to
the batcher. From this process:
(a) small bodies: ``--clients`` threads, each on its own kept-alive connection, send ``--requests`` requests in
    all, each one float32 tensor of 256 elements (a 1.2 KB body); requests per second.
(b) large bodies: one client sends a ``--large-mib`` MiB float32 tensor ``--large-repeats`` times; MB/s of body
    (10^6 bytes per second), the answer included.
Servers: ``new`` (this checkout's server: uvicorn with its h11 parser), ``new-httptools`` (the same with
uvicorn's httptools parser, where installed), and with ``--old PATH`` another ``rewards/server.py`` (e.g. the hand-made
http.server one, saved with ``git show REV:src/omnirl_core/rewards/server.py > old.py``), alternating in each
round (the order reversed every other round). Writes ``benchmarks/results/reward_server.json`` (the median
per server and every round's figures).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from omnirl_core.rewards.wire import CONTENT_TYPE, EncodedRequest

RESULTS = Path(__file__).resolve().parent / "results"

SERVE = """
import importlib.util, sys
path, http = sys.argv[1], sys.argv[2]
if path == "-":
    from omnirl_core.rewards import server as module
else:
    spec = importlib.util.spec_from_file_location("server_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
server = module.RewardServer(lambda outputs, prompts: [float(o.numel()) for o in outputs], "sizes", port=0,
                             max_connections=256, max_body_bytes=2 << 30)
if http != "-":
    server.config.http = http
print(server.port, flush=True)
server.serve_forever()
"""


def start(path: str, http: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", SERVE, path, http], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, port


def post(connection: http.client.HTTPConnection, body: EncodedRequest) -> list[float]:
    connection.putrequest("POST", "/score")
    connection.putheader("Content-Type", CONTENT_TYPE)
    connection.putheader("Content-Length", str(body.length))
    connection.endheaders()
    for chunk in body.chunks():
        connection.send(chunk)
    response = connection.getresponse()
    answer = json.loads(response.read())
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {answer}")
    return answer["scores"]


def small(port: int, clients: int, requests: int) -> float:
    import torch

    body = EncodedRequest([torch.arange(256, dtype=torch.float32)], ["a prompt"])
    per_client = requests // clients
    ready = threading.Barrier(clients + 1)
    errors: list[BaseException] = []

    def client() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            post(connection, body)  # connected and warm
            ready.wait()
            for _ in range(per_client):
                assert post(connection, body) == [256.0]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            ready.abort()
        finally:
            connection.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    ready.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise errors[0]
    return per_client * clients / elapsed


def large(port: int, mib: int, repeats: int) -> float:
    import torch

    numel = (mib << 20) // 4
    body = EncodedRequest([torch.ones(numel, dtype=torch.float32)], ["a prompt"])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        assert post(connection, body) == [float(numel)]  # warm: the buffers' first touch
        began = time.perf_counter()
        for _ in range(repeats):
            assert post(connection, body) == [float(numel)]
        elapsed = time.perf_counter() - began
    finally:
        connection.close()
    return body.length * repeats / elapsed / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", help="another rewards/server.py to run beside this checkout's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--large-mib", type=int, default=48)
    parser.add_argument("--large-repeats", type=int, default=5)
    args = parser.parse_args()
    servers = {"new": ("-", "-"), "new-httptools": ("-", "httptools")}
    if args.old:
        servers["old"] = (str(Path(args.old).resolve()), "-")
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    for r in range(args.rounds):
        for name in (list(servers) if r % 2 == 0 else list(reversed(servers))):
            proc, port = start(*servers[name])
            try:
                figures = {"requests_per_s": small(port, args.clients, args.requests),
                           "large_body_MB_per_s": large(port, args.large_mib, args.large_repeats)}
            finally:
                proc.terminate()
                proc.wait(30)
            rounds[name].append(figures)
            print(f"round {r} {name:13s} {figures['requests_per_s']:8.0f} requests/s  "
                  f"{figures['large_body_MB_per_s']:7.0f} MB/s", flush=True)
    median = {name: {key: round(statistics.median(f[key] for f in got), 1) for key in got[0]}
              for name, got in rounds.items()}
    for name, figures in median.items():
        print(f"median   {name:13s} {figures['requests_per_s']:8.0f} requests/s  "
              f"{figures['large_body_MB_per_s']:7.0f} MB/s")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "reward_server.json"
    path.write_text(json.dumps({"args": vars(args), "median": median, "rounds": rounds}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
