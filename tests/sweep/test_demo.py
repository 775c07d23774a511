from __future__ import annotations

from tierguard.sweep.demo import build_demo_matrix, demo_document, serve_flags

ALL = {"--kv-host-gib", "--kv-disk-dir", "--kv-disk-gib", "--kv-dtype", "--kv-naive-sync-disk"}


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
    assert tags >= {"reference", "host-tier", "disk-prefix", "fp8", "naive-sync-disk"}
    quick = build_demo_matrix(quick=True, available=ALL)
    assert {v.name for v in quick.matrix.variants} == set(demo_document()["quick"]["variants"])
    assert len(quick.matrix.profile.context_lengths) == 1
    assert quick.matrix.name != full.matrix.name  # separate run directories never collide


def test_serve_flags_reads_this_build():
    flags = serve_flags()
    assert "--kv-cache-gib" in flags and "--max-model-len" in flags
