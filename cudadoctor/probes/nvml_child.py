"""Run in a child process (``python -c``): query NVML through pynvml and print one JSON line.

Kept to the standard library plus pynvml so a hung or crashing NVML only takes this child down.
"""

import json
import sys

MARK = "CUDADOCTOR_NVML "


def _s(v):
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return v


def main():
    out = {"driver": None, "cuda": None, "gpus": [], "error": None}
    try:
        import pynvml
    except Exception as exc:  # noqa: BLE001
        out["error"] = "pynvml not importable: %s" % (exc,)
        print(MARK + json.dumps(out), flush=True)
        return
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001
        out["error"] = str(exc) or type(exc).__name__
        print(MARK + json.dumps(out), flush=True)
        return
    try:
        out["driver"] = _s(pynvml.nvmlSystemGetDriverVersion())
        try:
            fn = getattr(pynvml, "nvmlSystemGetCudaDriverVersion_v2", None) or pynvml.nvmlSystemGetCudaDriverVersion
            v = int(fn())
            out["cuda"] = "%d.%d" % (v // 1000, (v % 1000) // 10)
        except Exception as exc:  # noqa: BLE001
            out["cuda_error"] = str(exc)
        n = pynvml.nvmlDeviceGetCount()
        for i in range(n):
            g = {"index": i, "source": "nvml"}
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:  # noqa: BLE001
                g["error"] = str(exc)
                out["gpus"].append(g)
                continue
            for key, call in (
                ("name", lambda: _s(pynvml.nvmlDeviceGetName(h))),
                ("cc", lambda: "%d.%d" % tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h))),
                ("memory_mib", lambda: int(pynvml.nvmlDeviceGetMemoryInfo(h).total // (1024 * 1024))),
                ("uuid", lambda: _s(pynvml.nvmlDeviceGetUUID(h))),
                ("pci_bus_id", lambda: _s(pynvml.nvmlDeviceGetPciInfo(h).busId)),
            ):
                try:
                    g[key] = call()
                except Exception as exc:  # noqa: BLE001
                    g.setdefault("errors", {})[key] = str(exc)
            out["gpus"].append(g)
    except Exception as exc:  # noqa: BLE001
        out["error"] = str(exc) or type(exc).__name__
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    print(MARK + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
