# ruff: noqa: N802  (CuPy mirrors the CUDA driver names)
def launchKernel(
    f: int,
    grid_dim_x: int,
    grid_dim_y: int,
    grid_dim_z: int,
    block_dim_x: int,
    block_dim_y: int,
    block_dim_z: int,
    shared_mem_bytes: int,
    stream: int,
    kernel_params: int,
    extra: int,
) -> None: ...
