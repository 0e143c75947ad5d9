// The kernels as a Python module (kernels.py builds it): the names quant.py, compact.py and the tests call.
#include <torch/extension.h>

#include "common.h"  // (WOQ_SIMD)
#include "decoder.h"
#include "kernels.h"

using namespace woq;

// The calls an embedding model's forward makes from Python (the linears, encoder attention, the activations) let
// go of the GIL while they run: its engine runs a forward on each core at once, one thread each (engine/embedder.py).
// Their arguments are tensors; nothing in them touches a Python object.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // module_local: the module may be imported again from another path in one process (a relative and an
  // absolute model cache), which would otherwise register the class twice and fail the import
  py::class_<Decoder>(m, "Decoder", py::module_local(), "a decode step's layers over quantized weights, in one call")
      .def(py::init<const std::vector<LayerParts>&, int64_t, double, bool, double, double>(), py::arg("layers"),
           py::arg("heads"), py::arg("eps"), py::arg("gelu"), py::arg("attn_scale"), py::arg("softcap"))
      .def("forward", &Decoder::forward)
      .def("forward_lora", &Decoder::forward_lora);
#ifdef WOQ_SIMD
  m.attr("int8_scores") = true;  // an int8 cache's attention scores over int16 queries (ops.cpp: int8_scores)
#else
  m.attr("int8_scores") = false;
#endif
  m.def("linear_int8", &linear_int8, "x @ (q * s)^T, 8-bit weight groups", py::call_guard<py::gil_scoped_release>(),
        py::arg("x"), py::arg("q"), py::arg("s"), py::arg("bias"), py::arg("int8_inputs") = false,
        py::arg("vnni_q") = py::none(), py::arg("vnni_s") = py::none());
  m.def("linear_int4", &linear_int4, "x @ (d * q + m)^T, 4-bit weight groups of 32",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("q"), py::arg("d"), py::arg("m"),
        py::arg("bias"), py::arg("int8_inputs") = false, py::arg("vnni_q") = py::none(),
        py::arg("vnni_s") = py::none());
  m.def("linear_gguf", &linear_gguf, "x @ W^T for W a GGUF tensor's rows in their own blocks (raw [N, row bytes])",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("raw"), py::arg("type"), py::arg("bias"),
        py::arg("int8_inputs") = false, py::arg("packed") = py::none());
  m.def("pack_k8", &pack_k8, "k-quant, IQ4_XS, Q5_0, Q5_1 or IQ4_NL rows packed for the tiles (else empty)",
        py::arg("raw"), py::arg("type"));
  m.def("dequantize_gguf", &dequantize_gguf, "rows of a GGUF tensor's blocks as float32 [R, K]", py::arg("raw"),
        py::arg("type"));
  m.def("gguf_types", &gguf_types, "ggml's type numbers of the block types served in their own blocks");
  m.def("vnni", &vnni, "whether the VNNI tiles were built (AVX512-VNNI)");
  m.def("int8_peak", &int8_peak,
        "int8 multiply-adds a second on every thread with the level's tile instruction alone (the compute ceiling)",
        py::arg("steps"));
  m.def("packed_tiles", &packed_tiles, "whether every row count of quant.py's form runs on tiles over a packed copy",
        py::arg("form"));
  m.def("decode_attention", &decode_attention, "one query token per entry over its row's cached positions",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("ks"), py::arg("vs"), py::arg("lengths"), py::arg("scale"),
        py::arg("rows") = py::none(), py::arg("starts") = py::none(), py::arg("softcap") = 0.0, py::arg("ring") = 0);
  m.def("encoder_attention", &encoder_attention, "an encoder's inputs packed one after another, each over itself",
        py::call_guard<py::gil_scoped_release>(), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("offsets"),
        py::arg("heads"), py::arg("scale"));
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension");
  m.def("silu_mul", &silu_mul, "silu(gate) * up over the last dimension's halves [gate | up]",
        py::call_guard<py::gil_scoped_release>());
  m.def("gelu", &gelu, "GELU in its tanh form (llama.cpp's)", py::call_guard<py::gil_scoped_release>());
  m.def("rope_store", &rope_store, "rotary embedding, each token's key and value into the cache", py::arg("qkv"),
        py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"), py::arg("key_scales"),
        py::arg("value_scales"), py::arg("positions"), py::arg("heads"), py::arg("rows") = py::none());
  m.def("sample_rows", &sample_rows,
        "each row's token: the argmax (temperature <= 0), else a draw by its uniform number after top-k, top-p, min-p",
        py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"),
        py::arg("uniforms"));
  m.def("lora_add", &lora_add,
        "y[t] += scale * (x[t] . a[s]) b[s] for each (token t, slot s, scale): LoRA adapters' low-rank terms",
        py::arg("x"), py::arg("a"), py::arg("b"), py::arg("tokens"), py::arg("slots"), py::arg("scales"), py::arg("y"));
}
