// The Python module fastnmt._C: importing it runs the TORCH_LIBRARY registrations of every
// kernel file; the ops are then reached as torch.ops.fastnmt.*.
#include <Python.h>

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
