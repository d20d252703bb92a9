// precast._C: the Python face of the C++ runtime and the CPU kernels.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cpu_features.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "precast C++ runtime and CPU kernels";
  m.attr("__version__") = PRECAST_VERSION;

  m.def(
      "cpu_features",
      [] {
        const precast::CpuFeatures& f = precast::cpu_features();
        py::dict d;
        d["avx2"] = f.avx2;
        d["fma"] = f.fma;
        d["f16c"] = f.f16c;
        d["avx512f"] = f.avx512f;
        d["avx512bw"] = f.avx512bw;
        d["avx512vl"] = f.avx512vl;
        d["avx512_vnni"] = f.avx512_vnni;
        d["avx512_bf16"] = f.avx512_bf16;
        d["logical_cores"] = f.logical_cores;
        return d;
      },
      "Instruction sets this CPU and OS support, as detected by cpuid/xgetbv.");
  m.def("best_isa", &precast::best_isa,
        "The widest instruction set precast's CPU kernels use here: 'avx512', 'avx2' or 'scalar'.");
}
