"""Helpers for the end-to-end tests: free loopback ports and deployment configs."""

import socket

import yaml

from moepipe.config import parse_config


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def make_config(workdir, example="tiny-mixtral", **overrides):
    http, grpc, metrics, ranks = free_ports(4)
    data = {"model": {"example": example}, "target": "cpu",
            "parallel": {"tp": 2, "moe_ep": 2},
            "build": {"max_batch_size": 16, "max_input_len": 256, "max_seq_len": 512},
            "deploy": {"http_port": http, "grpc_port": grpc, "metrics_port": metrics,
                       "rank_port": ranks, "ready_timeout_s": 240},
            "validate": {"max_tokens": 12},
            "workdir": str(workdir)}
    for section, values in overrides.items():
        data.setdefault(section, {}).update(values)
    (workdir).mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(data)
    (workdir / "moepipe.yaml").write_text(text)
    cfg = parse_config(data, str(workdir / "moepipe.yaml"), text)
    return cfg.resolve_paths(workdir)
