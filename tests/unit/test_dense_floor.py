"""CPU checks of the dense feasibility probe (verl_quads/bench/dense_floor.py): the read kernel's per-program sums
(Triton interpreter) against a direct loop over the words, the byte count it reads per weight, the verdict."""

import pytest
import torch

from verl_quads.bench import dense_floor as df


def _loop_sums(w: torch.Tensor, cfg: df.ReadConfig) -> list[int]:
    p = df.read_programs(w.numel(), cfg)
    out = []
    for pid in range(p):
        s = sum(int(v) for v in w[pid * cfg.words_per_program:(pid + 1) * cfg.words_per_program]) & 0xFFFFFFFF
        out.append(s - (1 << 32) if s >= 1 << 31 else s)
    return out


@pytest.mark.parametrize("cfg", [df.ReadConfig(4, 1, 1), df.ReadConfig(8, 2, 1), df.ReadConfig(4, 3, 2)],
                         ids=lambda c: c.label)
@pytest.mark.parametrize("n_words", [1, 777, 4096])
def test_read_sum_matches_a_loop_over_the_words(cfg, n_words):
    g = torch.Generator().manual_seed(n_words)
    w = torch.randint(-2**31, 2**31 - 1, (n_words,), dtype=torch.int32, generator=g)
    got = df.read_sum(w, cfg)
    assert got.tolist() == _loop_sums(w, cfg)
    assert torch.equal(got, df.read_sum_reference(w, cfg))


def test_read_sum_rejects_other_buffers():
    with pytest.raises(ValueError, match="int32"):
        df.read_sum(torch.zeros(16, dtype=torch.int64), df.ReadConfig())
    with pytest.raises(ValueError, match="1-D"):
        df.read_sum(torch.zeros(4, 4, dtype=torch.int32), df.ReadConfig())


def test_empty_kernel_stores_program_ids():
    out = torch.full((5,), -1, dtype=torch.int32)
    assert df.empty_launch(out).tolist() == [0, 1, 2, 3, 4]


def test_weight_words_counts_codes_and_scales():
    # 4096 x 4096: 8 MiB of codes + 1 MiB of e4m3 scales
    assert df.weight_words(4096, 4096) * 4 == 4096 * 4096 // 2 + 4096 * 4096 // 16
    with pytest.raises(ValueError, match="multiple of 64"):
        df.weight_words(16, 48)


def test_read_configs_are_distinct_and_whole_tiles():
    assert len(set(df.READ_CONFIGS)) == len(df.READ_CONFIGS)
    for c in df.READ_CONFIGS:
        assert c.tile == c.vec * 32 * c.num_warps and c.tile & (c.tile - 1) == 0


def test_verdict():
    assert "unreachable" in df.verdict(4.0, 4.5)
    assert "0.50 us left" in df.verdict(5.0, 4.5)
