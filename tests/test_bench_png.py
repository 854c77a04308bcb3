"""bench.png carries what the text report says of the noise: a speedup within the run's own noise (plain against
itself) is hatched and says so on its bar, and a busy machine's warning is printed on the figure."""

from __future__ import annotations

from eyas.bench.render import bench_figure


def results(load: float) -> dict:
    methods = {"plain": {"tok_s": 10.0, "tau": 1.0, "speedup_vs_plain": 1.0},
               "tree": {"tok_s": 4.3, "tau": 1.2, "speedup_vs_plain": 0.43},  # inside ±170%: the machine
               "lookup": {"tok_s": 40.0, "tau": 3.0, "speedup_vs_plain": 4.0}}  # beyond it: measured
    return {"summary": {"methods": methods, "noise": {"ratio": 1.1, "spread": 1.7, "prompts": 8, "same": 8}},
            "config": {"bench": "mt-bench", "max_new_tokens": 128, "lookup_tokens": 4}, "specs": {},
            "environment": {"device": "cpu", "threads": 2, "dtype": "float32", "cpu_count": 2, "loadavg_1m": load},
            "target": {"name": "smollm2-135m"}, "num_prompts": 8}


def test_speedups_within_the_noise_are_marked_and_the_busy_warning_is_drawn():
    fig = bench_figure(results(load=3.5))
    a = fig.axes[0]
    hatched = [p.get_hatch() for p in a.patches]
    assert hatched == [None, "//", None]
    notes = [t.get_text() for t in a.texts]
    assert notes == ["1.00x", "0.43x\nwithin noise", "4.00x"]
    assert any("the machine was busy (load 3.5 on 2 CPUs)" in t.get_text() for t in fig.texts)


def test_a_quiet_machine_has_no_warning_on_the_figure():
    fig = bench_figure(results(load=0.2))
    assert not [t for t in fig.texts if "busy" in t.get_text()]
