"""Stands in for torch's compiled extension: a CUDA 12.1 build for sm_50..sm_90 that sees one GPU."""
_GLIBCXX_USE_CXX11_ABI = False
_has_cudnn = False


def _cuda_getArchFlags():
    return "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90"


def _cuda_getDeviceCount():
    return 1
