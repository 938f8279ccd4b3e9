"""bench_anchor_mass's launch A/B options: each spec becomes the launch config it names, and a malformed or
invalid spec stops the benchmark with a message that names the option and the expected form."""
import pytest

from benchmarks.bench_anchor_mass import parse_mass_configs, parse_topk_configs
from vc_compile.kernels import configs as KC


def test_launch_specs_parse():
    assert parse_mass_configs("1/shift/3,2/exact/4") == [
        KC.AnchorMassConfig(groups_per_program=1, exp="shift", num_stages=3),
        KC.AnchorMassConfig(groups_per_program=2, exp="exact", num_stages=4)]
    assert parse_topk_configs("8192/8/8,4096/4/16") == [KC.TopKConfig(block=8192, digit=8, num_warps=8),
                                                        KC.TopKConfig(block=4096, digit=4, num_warps=16)]
    assert parse_mass_configs("") == [] and parse_topk_configs("") == []


@pytest.mark.parametrize("fn,opt,spec", [(parse_topk_configs, "--topk-configs", "8192/8"),
                                         (parse_topk_configs, "--topk-configs", "1000/8/8"),
                                         (parse_mass_configs, "--mass-configs", "3/shift/3")])
def test_bad_launch_specs_stop_with_the_option_named(fn, opt, spec):
    with pytest.raises(SystemExit, match=f"{opt} '{spec}': expected"):
        fn(spec)
