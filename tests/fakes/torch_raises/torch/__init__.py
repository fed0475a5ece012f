raise ImportError("libcudnn.so.9: cannot open shared object file: No such file or directory (fake torch)")
