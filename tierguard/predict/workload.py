"""A cell's workload as the sweep's bench client would send it: requests and due times.

The sweep builds each cell's `tierguard bench` command line from the matrix alone
(tierguard/sweep/benchcall.py); here the same command line is parsed by the bench's own
parser and planned by the bench's own `plan_requests` (datasets, lengths, seeds, open or
closed loop, arrival offsets, warm-up). Only the prompt text differs: prompts are made
of numbered units, one unit per token, so a prompt's token ids are known without a
tokenizer or a server, and what requests share (a prefix, a session's history) is
shared token for token, as the real prompts share it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierguard.bench.config import BenchConfig
from tierguard.bench.prompts import PromptMaker
from tierguard.sweep.benchcall import bench_argv
from tierguard.sweep.cells import CellSpec
from tierguard.sweep.matrix import Matrix

FIRST_ID = 16  # ids below are left out (special tokens of most vocabularies)


class UnitPrompts(PromptMaker):
    """One unit = one token id; the text is the ids, so counting is exact by construction."""

    exact = True
    source = "simulated"

    def __init__(self, vocab: int = 32000) -> None:
        self.vocab = max(FIRST_ID + 2, vocab)

    def random_units(self, n: int, rng: np.random.Generator) -> list:
        return [int(i) for i in rng.integers(FIRST_ID, self.vocab, size=n)]

    def render(self, units: list) -> str:
        return " ".join(str(u) for u in units)

    def count(self, text: str) -> int:
        return len(text.split())


def token_ids(prompt: str) -> list[int]:
    return [int(t) for t in prompt.split()]


@dataclass
class Workload:
    config: BenchConfig
    prompts: list[list[int]]
    output_lens: list[int]
    offsets: list[float]  # due times (s) in open loop; zeros in closed loop
    closed_loop: bool
    concurrency: int | None
    num_requests: int


def bench_config(argv: list[str]) -> BenchConfig:
    """The BenchConfig the bench CLI would build from `argv` (without 'bench')."""
    from tierguard.cli import bench as bench_cli

    sub = argparse.ArgumentParser().add_subparsers()
    parser = bench_cli.add_parser(sub)
    args = parser.parse_args(argv[1:] if argv and argv[0] == "bench" else argv)
    return bench_cli.config_from_args(args)


def cell_workload(matrix: Matrix, spec: CellSpec, vocab: int = 32000, repeat: int = 0) -> Workload:
    """The requests of one sweep cell, planned by the bench's own code."""
    from tierguard.bench.runner import plan_requests

    argv = bench_argv(matrix, spec, "http://simulated", matrix.profile.model, Path("unused"), repeat=repeat)
    cfg = bench_config(argv)
    cfg.tokenizer = None  # prompts are unit ids (module docstring)
    specs, offsets = plan_requests(cfg, UnitPrompts(vocab))
    return Workload(
        config=cfg,
        prompts=[token_ids(s.prompt) for s in specs],
        output_lens=[s.output_len for s in specs],
        offsets=list(offsets),
        closed_loop=cfg.closed_loop,
        concurrency=cfg.max_concurrency,
        num_requests=len(specs),
    )


def probe_workload(input_len: int, output_len: int, concurrency: int, num_requests: int, seed: int,
                   vocab: int = 32000) -> Workload:
    """A closed-loop probe of fixed-length requests (calibration's own cells)."""
    from tierguard.bench.runner import plan_requests

    cfg = BenchConfig(dataset="fixed", input_len=input_len, output_len=output_len, max_concurrency=concurrency,
                      num_requests=num_requests, seed=seed)
    specs, offsets = plan_requests(cfg, UnitPrompts(vocab))
    return Workload(cfg, [token_ids(s.prompt) for s in specs], [s.output_len for s in specs], list(offsets),
                    cfg.closed_loop, concurrency, len(specs))
