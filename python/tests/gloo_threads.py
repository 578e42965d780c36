"""What the spawned-rank workers (nn_ddp_worker.py, exchange_worker.py) check after
destroy_process_group: a Gloo thread still running then is one the interpreter's exit tears
down, which aborts the process."""
import os


def gloo_threads():
    """The names of this process's Gloo threads (pt_gloo_*)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return [n for n in names if n.startswith("pt_gloo")]
