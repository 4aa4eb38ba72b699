// The Python module deepinfer_ops._C. Importing it runs the static initialisers of
// torch_bindings.cpp, which register every op under torch.ops.deepinfer_ops.*.
#include <Python.h>

static struct PyModuleDef deepinfer_module = {PyModuleDef_HEAD_INIT, "_C",
                                              "deepinfer native ops (registered as torch.ops.deepinfer_ops.*)", -1,
                                              nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&deepinfer_module);
  if (m == nullptr) return nullptr;
#ifdef DEEPINFER_WITH_CUDA
  PyModule_AddIntConstant(m, "WITH_CUDA", 1);
#else
  PyModule_AddIntConstant(m, "WITH_CUDA", 0);
#endif
  return m;
}
