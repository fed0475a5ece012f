"""Fake pynvml reporting one H200 on driver 570.133.20 (CUDA 12.8)."""


class _Mem:
    total = 150754820096


class _Pci:
    busId = "00000000:19:00.0"


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlSystemGetDriverVersion():
    return "570.133.20"


def nvmlSystemGetCudaDriverVersion_v2():
    return 12080


def nvmlDeviceGetCount():
    return 1


def nvmlDeviceGetHandleByIndex(i):
    return i


def nvmlDeviceGetName(h):
    return "NVIDIA H200"


def nvmlDeviceGetCudaComputeCapability(h):
    return (9, 0)


def nvmlDeviceGetMemoryInfo(h):
    return _Mem()


def nvmlDeviceGetUUID(h):
    return "GPU-3f1c2b7a-8e4d-4c6b-a1f2-9d0e8c7b6a54"


def nvmlDeviceGetPciInfo(h):
    return _Pci()
