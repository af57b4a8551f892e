"""The bottom of REST Lab: what the engine (`rest_core`) and the stores (`datastores`) both need.

* `rest_base.files` -- the cache folder (`cache_dir`), whole-or-nothing writes (`write_atomic`), file-name parts
  (`safe_file_name`) and JSON files that read as absent when unreadable (`read_json`, `write_json`);
* `rest_base.machine` -- what this CPU is (`cpu_info`, from the one reader of /proc/cpuinfo) and the key the
  native build is kept under (`cpu_key`);
* `rest_base.native_build` -- the C++ build step (`build`, `optional_library`, REST_LAB_NATIVE), stale builds
  removed, and data addresses for native calls (`address`);
* `rest_base.native_policy` -- whether the stores and the cost model take their native paths (`NativePolicy`);
* `rest_base.calibration` -- one file per timed choice on this machine (`CalibrationFile`: the linear kernels,
  the attention kernel, the cost curve).

It imports neither `datastores` nor `rest_core` (tests/test_layers.py), nor torch.
"""
