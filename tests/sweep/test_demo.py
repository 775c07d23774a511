from __future__ import annotations

import shlex

from tierguard.sweep.demo import build_demo_matrix, demo_document, serve_flags

ALL = {"--kv-host-gib", "--kv-disk-dir", "--kv-disk-gib", "--kv-dtype", "--kv-naive-sync-disk"}
# The flags that define the workload an engine can serve: equal for every variant (R10).
SHARED = ("--model", "--max-model-len", "--max-num-seqs")


def _flags(command: str) -> dict[str, str]:
    words = shlex.split(command)
    return {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}


def test_variants_without_their_flags_are_left_out_and_named():
    d = build_demo_matrix(available={"--port"})
    assert [v.name for v in d.matrix.variants] == ["reference", "small-pool"]
    assert d.skipped["naive-sync-disk"] == [
        "--kv-host-gib",
        "--kv-disk-dir",
        "--kv-disk-gib",
        "--kv-naive-sync-disk",
    ]


def test_full_and_quick_matrices_with_every_flag():
    full = build_demo_matrix(available=ALL)
    assert len(full.matrix.variants) == len(demo_document()["matrix"]["variants"]) and not full.skipped
    tags = {t for v in full.matrix.variants for t in v.tags}
    assert tags >= {"reference", "no-tier", "host-tier", "disk-prefix", "fp8", "naive-sync-disk"}
    quick = build_demo_matrix(quick=True, available=ALL)
    assert {v.name for v in quick.matrix.variants} == set(demo_document()["quick"]["variants"])
    assert len(quick.matrix.profile.context_lengths) == 1
    assert quick.matrix.name != full.matrix.name  # separate run directories never collide
    # The quick run keeps the story: the contract, the naive mode and the prefix slice.
    assert {"disk-prefix", "naive-sync-disk", "no-tier"} <= {t for v in quick.matrix.variants for t in v.tags}
    assert quick.matrix.slices.prefix is not None


def test_every_variant_serves_the_same_workload():
    m = build_demo_matrix(available=ALL).matrix
    flags = [_flags(v.command) for v in m.variants]  # type: ignore[arg-type]
    for f in flags:
        assert all(f[k] == flags[0][k] for k in SHARED), f
    # Every prompt of every slice fits the engines' max_model_len with its output.
    longest = max([*m.profile.context_lengths, m.slices.prefix.context if m.slices.prefix else 0])
    assert int(flags[0]["--max-model-len"]) >= longest + m.profile.output_len
    # The prefix slice reuses each prefix; every non-reference variant has the same small
    # pool, so the tiers (or their absence) are the only difference.
    pre = m.slices.prefix
    assert pre is not None and pre.requests_per_prefix >= 2
    small = {f["--kv-cache-gib"] for v, f in zip(m.variants, flags, strict=True) if "reference" not in v.tags}
    assert len(small) == 1


def test_serve_flags_reads_this_build():
    flags = serve_flags()
    assert "--kv-cache-gib" in flags and "--max-model-len" in flags
