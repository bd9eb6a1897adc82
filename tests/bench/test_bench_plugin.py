"""The bench kit as the product's plugin: its entry point adds `privlm bench`, whose sweeps load only when a bench
command runs."""


def test_the_bench_kit_adds_its_commands_through_its_entry_point():
    from privlm.plugins import bench_installed, command_plugins
    from privlm_bench.cli import add_commands

    assert bench_installed() and command_plugins()["bench"]() is add_commands


def test_privlm_starts_without_loading_the_sweeps():
    """`privlm snd serve`, `privlm gateway`: the bench's commands are added, its sweeps (torch, peft, matplotlib)
    load only when a bench command runs."""
    import subprocess
    import sys

    code = ("import sys; from privlm.cli import app; "
            "print(sorted(m for m in sys.modules if m.startswith('privlm_bench.') and m.count('.') > 1))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "privlm_bench.cli.app" in loaded
    assert not any(f"privlm_bench.{part}" in loaded for part in ("harness", "snd.sweep", "cape.sweep", "sap.sweep"))
