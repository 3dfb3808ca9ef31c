// Fused BEV pooling: the op schemas (one for every device) and the Python module stub. The argument
// checks the CPU (bev_pool_cpu.cpp) and CUDA (bev_pool_cuda.cu) kernels share are in bev_pool_checks.cpp.
#include <Python.h>

#include <torch/library.h>

#include "bev_pool.h"

extern "C" {
// `import stack._C` loads this library, which runs the TORCH_LIBRARY registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace stack {

TORCH_LIBRARY(stack, m) {
  m.def("bev_pool(Tensor depth, Tensor feat, Tensor ranks_depth, Tensor ranks_feat, Tensor ranks_bev, "
        "Tensor interval_starts, Tensor interval_lengths, int batch, int grid_x, int grid_y) -> Tensor");
  m.def("bev_pool_backward(Tensor grad_out, Tensor depth, Tensor feat, Tensor ranks_depth, Tensor ranks_feat, "
        "Tensor ranks_bev) -> (Tensor, Tensor)");
  // The geometry tables (ranks_depth, ranks_feat, ranks_bev, interval_starts, interval_lengths) from the rays in
  // grid units; CPU only (bev_geometry_cpu.cpp), elsewhere stack.ops.bev_geometry runs its PyTorch path.
  m.def("bev_geometry_ranks(Tensor slopes, Tensor offsets, Tensor bins, int grid_x, int grid_y) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

}  // namespace stack
