"""An engine nobody shut down (a running request, the shared get_engine() one) stops its scheduler
thread at interpreter exit, so the process exits cleanly instead of tearing the thread down
inside a torch op."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_scheduler_threads_stop_before_interpreter_exit(tiny_llama_dir) -> None:
    script = textwrap.dedent(f"""
        import atexit, threading

        @atexit.register  # registered first, so it runs after radix_backend's own exit hook
        def report():
            alive = [t.name for t in threading.enumerate() if t.name == "radix-scheduler" and t.is_alive()]
            print("ALIVE_AT_EXIT", alive, flush=True)

        from radix_backend import SamplingParams, get_engine
        engine = get_engine({str(tiny_llama_dir)!r}, device="cpu", kv_cache_tokens=4096)
        print(engine.generate("Hello", SamplingParams(max_new_tokens=2, temperature=0)).token_ids, flush=True)
        handle = engine.submit("Tell me a long story", SamplingParams(max_new_tokens=2000, ignore_eos=True))
        print("EXITING with a request in flight", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "EXITING" in done.stdout and "ALIVE_AT_EXIT []" in done.stdout, done.stdout + done.stderr[-2000:]
