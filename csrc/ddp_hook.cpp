// The DDP hook's fp32 and bf16 averages in C++ (hvd_terngrad/ddp.py: TernGradState.register), built against torch as
// the extension hvd_terngrad._ddp_hook where setup.py finds torch at build time.
//
// Why: where transport="auto" keeps every bucket in fp32 (a fast link), the hook's work is DDP's own allreduce
// plus a pass and a few reads, yet any hook written in Python costs its step 5-6% against DDP's built-in C++
// allreduce on the emulated fast cluster (docs/notes/tta-log.md, "The DDP hook in C++"): the hook's call,
// the allreduce's launch and the callback each cross into Python. Here those steps run with no Python: the
// scaling by 1/N with the largest |value| read in the same pass (the codec's tg_scale, given by address), the
// allreduce on the hook's own process group, and the check of the average where a rank's marker can be. In bf16
// (half the bytes, fp32's exponent range: no scale to choose, nothing overflows that fp32 would not) the scaled
// buffer is rounded into a bf16 copy, which travels, and read back into the buffer before the check: a rank's
// markers (+Inf, zeros) survive the rounding.
//
// Everything else stays in Python, in one home: every bucket goes to terngrad_hook until Python turns this path on
// (Control.enable, between steps: auto's plan for the next step is fp32 or bf16 for every bucket, on the CPU, in
// its trial or decided); a bucket's layout, a rank's markers, a non-finite average's error and the step's end (its
// byte counts and pipeline.next_step) are calls into Python (hvd_terngrad/ddp/native.py, Native), the first on a new layout, the
// next two only where a value is out of range, the last once a step; and on the step after a coded one, with
// error feedback, each bucket's residuals merged (once a bucket).
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/python.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using c10::ivalue::Future;
using FuturePtr = c10::intrusive_ptr<Future>;

namespace {

// csrc/terngrad_half.cpp's tg_scale: x *= scale in place, *absmax the largest |x| after (NaN where x holds one).
using ScaleFn = int (*)(float* x, int64_t n, float scale, double* absmax, int nthreads);

// Where a bucket's average can carry a rank's marker (finite.marker_positions), for the buffer and parameters it
// was read for: DDP may plan its buckets again, so every call checks them, at the cost of a few compares.
struct Layout {
  const void* buffer = nullptr;          // the bucket's buffer
  int64_t numel = 0;                     // its elements
  std::vector<const void*> params;       // its parameters (TensorImpl), in order
  std::vector<int64_t> at;               // the positions to read; all of them where `whole`
  bool whole = false;                    // a marker can be almost anywhere: read the whole average
  int nthreads = 1;                      // tg_scale's threads for this buffer
  mutable at::Tensor wire;               // the bf16 copy that travels (made on the first bf16 average)

  bool fits(const at::Tensor& buf, const std::vector<at::Tensor>& ps) const {
    if (buf.data_ptr() != buffer || buf.numel() != numel || ps.size() != params.size()) return false;
    for (size_t i = 0; i < ps.size(); ++i)
      if (ps[i].unsafeGetTensorImpl() != params[i]) return false;
    return true;
  }

  bool finite(const float* x) const {
    if (whole) {
      for (int64_t i = 0; i < numel; ++i)
        if (!std::isfinite(x[i])) return false;
      return true;
    }
    for (int64_t i : at)
      if (!std::isfinite(x[i])) return false;
    return true;
  }
};

// What the hook and Python share: set by Python between steps (enable, disable), read by the hook on the thread
// that runs backward (which alone touches `layouts`, `checks` and `buckets`), and by the allreduces' callbacks on
// gloo's thread.
struct Control {
  std::atomic<bool> on{false};                  // this path averages every bucket; off: terngrad_hook does
  c10::intrusive_ptr<c10d::ProcessGroup> group; // the hook's own process group (ddp._own_group)
  int size = 1;                                 // its world size
  float factor = 1.0f;                          // 1 / size, as DDP's reducer scales
  double limit = 0.0;                           // the largest |value| a rank sends (ddp.averages.sendable)
  ScaleFn scale = nullptr;                      // the codec's tg_scale
  bool bf16 = false;                            // the average travels in bf16 (else in fp32, in place)
  bool merge = false;  // each bucket first takes a coded step's error-feedback residuals, in Python (the step after)
  int64_t step = 0;                             // the pipeline's step, which Python's step_done advances
  py::object native;                            // a weakref to ddp.native.Native, the calls into Python (it holds this)
  std::unordered_map<size_t, std::shared_ptr<const Layout>> layouts;  // bucket index -> its layout
  std::vector<FuturePtr> checks;                // this step's earlier buckets' checked averages
  std::vector<int64_t> buckets;                 // this step's bucket indices (their byte counts: step_done)
  std::atomic<bool> held{false};                // a check of this step found a non-finite average to raise
  bool at_end = false;  // the step's end in Python once it has completed (auto's trial times every kind so), not
                        // while its last allreduce travels (set by enable, read at the step's last bucket)

  ~Control() {
    py::gil_scoped_acquire gil;
    native = py::object();
  }
};

// The callbacks hold the Control weakly: gloo's thread lets go of a callback after it ran, maybe after the training
// has torn its process groups down, and the last reference to the hook's group must not go there (a process group
// destroyed on its own thread aborts the process; ddp.py). While a callback runs, DDP waits and holds the hook.
std::shared_ptr<Control> alive(const std::weak_ptr<Control>& weak) {
  std::shared_ptr<Control> c = weak.lock();
  TORCH_CHECK(c, "hvd_terngrad: a DDP bucket's average completed after its hook was gone");
  return c;
}

// A Python exception met in a call from here, as the message DDP raises (it would raise a callback's so).
std::string python_error(py::error_already_set& e) {
  return std::string(py::str(e.type().attr("__name__"))) + ": " + std::string(py::str(e.value()));
}

class Hook final : public c10d::CommHookInterface {
 public:
  Hook(std::shared_ptr<Control> control, py::object state, py::object hook)
      : control_(std::move(control)), python_(std::move(state), std::move(hook)) {}

  FuturePtr runHook(c10d::GradBucket& bucket) override {
    if (!control_->on.load()) return python_.runHook(bucket);
    Control& c = *control_;
    at::Tensor buf = bucket.getBufferRef();
    TORCH_CHECK(buf.scalar_type() == at::kFloat && buf.device().is_cpu() && buf.is_contiguous(),
                "hvd_terngrad: DDP bucket ", bucket.getIndex(), " is not a contiguous fp32 buffer on the CPU, which "
                "the C++ path of the hook averages (the buckets were so when it was turned on)");
    const size_t index = bucket.getIndex();
    std::shared_ptr<const Layout> layout = this->layout(bucket, buf);
    if (c.merge) call("merge", index);  // before the scaling, as ddp.averages.OwnAverages.start merges them
    double top = 0.0;
    TORCH_CHECK(c.scale(buf.data_ptr<float>(), buf.numel(), c.factor, &top, layout->nthreads) == 0,
                "hvd_terngrad: tg_scale failed on DDP bucket ", index);
    const int64_t step = c.step;
    if (!(top <= c.limit)) call("mark", index);  // NaN included: the tensors beyond the limit carry this rank's marker
    at::Tensor sent = buf;
    if (c.bf16) {
      if (!layout->wire.defined()) layout->wire = at::empty({buf.numel()}, buf.options().dtype(at::kBFloat16));
      sent = layout->wire.copy_(buf);
    }
    std::vector<at::Tensor> tensors{sent};
    FuturePtr sum = c.group->allreduce(tensors)->getFuture();
    std::weak_ptr<Control> weak = control_;
    FuturePtr checked = sum->then(
        [weak, buf, sent, layout, index, step](Future& f) -> c10::IValue {
          std::shared_ptr<Control> ctl = alive(weak);
          if (f.hasError()) {
            std::string what;
            try {
              std::rethrow_exception(f.exception_ptr());
            } catch (const std::exception& e) {
              what = e.what();
            }
            throw std::runtime_error(call_on(*ctl, "failed", index, what, step));
          }
          if (!sent.is_same(buf)) buf.copy_(sent);  // the bf16 average back into the bucket
          if (!layout->finite(buf.data_ptr<float>()) && call_on(*ctl, "nonfinite", index, step) == "held")
            ctl->held.store(true);
          return c10::IValue(buf);
        },
        c10::TensorType::get());
    c.buckets.push_back(static_cast<int64_t>(index));
    if (!bucket.isLast()) {
      c.checks.push_back(checked);
      return checked;
    }
    // The step's end, in Python: its byte counts and the pipeline's step, while its last allreduce travels, or
    // in auto's trial once the step has completed (ended, below)
    std::vector<int64_t> buckets;
    buckets.swap(c.buckets);
    if (!c.at_end) {
      c.step = std::stoll(call("step_done", buckets));
      buckets.clear();  // nothing left for the step's completion to end
    }
    if (c.checks.empty()) return last(weak, checked, buckets);
    std::vector<FuturePtr> all;
    all.swap(c.checks);
    all.push_back(checked);
    auto list = c10::List<FuturePtr>(c10::FutureType::create(c10::TensorType::get()));
    for (auto& f : all) list.push_back(f);
    // The last bucket completes once every check of the step has run: a non-finite average leaves with it
    // (the step's earlier buckets' errors would let DDP end the step while allreduces are in flight, ddp.py)
    return c10::collectAll(list)->then(
        [weak, checked, buckets](Future& f) -> c10::IValue {
          Control& ctl = *alive(weak);
          ended(ctl, buckets);
          if (f.hasError()) {  // a failed allreduce, at once (collectAll has waited for every check of the step)
            // a non-finite average this step held leaves with the step, not at the next step's end
            if (ctl.held.exchange(false)) call_on(ctl, "raise_held");
            std::rethrow_exception(f.exception_ptr());
          }
          return finish(ctl, checked);
        },
        c10::TensorType::get());
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    return result.isPyObject() ? python_.parseHookResult(result) : result.toTensor();
  }

 private:
  // The step's last bucket alone: its check, then any error held.
  static FuturePtr last(const std::weak_ptr<Control>& weak, const FuturePtr& checked,
                        const std::vector<int64_t>& buckets) {
    return checked->then(
        [weak, checked, buckets](Future&) -> c10::IValue {
          Control& ctl = *alive(weak);
          ended(ctl, buckets);
          return finish(ctl, checked);
        },
        c10::TensorType::get());
  }

  // The step's end where it waited for the step to complete (Control.at_end: `buckets` holds the step's buckets),
  // before anything it raises, as the Python path's step ends.
  static void ended(Control& c, const std::vector<int64_t>& buckets) {
    if (!buckets.empty()) c.step = std::stoll(call_on(c, "step_done", buckets));
  }

  static c10::IValue finish(Control& c, const FuturePtr& checked) {
    if (c.held.exchange(false)) {
      std::string message = call_on(c, "raise_held");
      if (!message.empty()) throw std::runtime_error(message);
    }
    if (checked->hasError()) std::rethrow_exception(checked->exception_ptr());
    return checked->value();
  }

  std::shared_ptr<const Layout> layout(c10d::GradBucket& bucket, const at::Tensor& buf) {
    Control& c = *control_;
    const std::vector<at::Tensor> params = bucket.getParameters();
    auto it = c.layouts.find(bucket.getIndex());
    if (it != c.layouts.end() && it->second->fits(buf, params)) return it->second;
    auto made = std::make_shared<Layout>();
    made->buffer = buf.data_ptr();
    made->numel = buf.numel();
    for (const auto& p : params) made->params.push_back(p.unsafeGetTensorImpl());
    {
      py::gil_scoped_acquire gil;
      py::tuple got;
      try {
        py::object native = c.native();
        TORCH_CHECK(!native.is_none(), "hvd_terngrad: the DDP hook's state is gone");
        got = native.attr("layout")(bucket).cast<py::tuple>();
      } catch (py::error_already_set& e) {
        throw std::runtime_error(python_error(e));
      }
      made->nthreads = got[1].cast<int>();
      if (got[0].is_none())
        made->whole = true;
      else
        made->at = got[0].cast<std::vector<int64_t>>();
    }
    if (bucket.isLast()) {  // fewer buckets than before: theirs no longer hold their old buffers
      for (auto i = c.layouts.begin(); i != c.layouts.end();)
        i = i->first > bucket.getIndex() ? c.layouts.erase(i) : std::next(i);
    }
    c.layouts[bucket.getIndex()] = made;
    return made;
  }

  template <typename... Args>
  std::string call(const char* name, Args&&... args) {
    return call_on(*control_, name, std::forward<Args>(args)...);
  }

  // native.<name>(args) with the GIL, its result as a string ("" for None); a Python error raised as its message.
  template <typename... Args>
  static std::string call_on(Control& c, const char* name, Args&&... args) {
    py::gil_scoped_acquire gil;
    try {
      py::object native = c.native();
      TORCH_CHECK(!native.is_none(), "hvd_terngrad: the DDP hook's state is gone");
      py::object out = native.attr(name)(std::forward<Args>(args)...);
      return out.is_none() ? std::string() : std::string(py::str(out));
    } catch (py::error_already_set& e) {
      throw std::runtime_error(python_error(e));
    }
  }

  std::shared_ptr<Control> control_;
  c10d::PythonCommHook python_;  // terngrad_hook, for every bucket while this path is off
};

// The hook registered on a DDP model's reducer: the C++ path, off until Python turns it on, before terngrad_hook.
std::shared_ptr<Control> register_hook(py::object reducer, py::object native, py::object state, py::object hook) {
  auto control = std::make_shared<Control>();
  control->native = std::move(native);
  reducer.cast<c10d::Reducer*>()->register_comm_hook(
      std::make_unique<Hook>(control, std::move(state), std::move(hook)));
  return control;
}

}  // namespace

PYBIND11_MODULE(_ddp_hook, m) {
  m.doc() = "The DDP hook's fp32 and bf16 averages in C++ (hvd_terngrad.ddp.TernGradState.register)";
  py::class_<Control, std::shared_ptr<Control>>(m, "Control")
      .def("enable",
           [](Control& c, py::object group, int size, uintptr_t scale, double limit, int64_t step, bool at_end,
              bool bf16, bool merge) {
             c.group = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
             c.size = size;
             c.factor = static_cast<float>(1.0 / size);  // as Python's ctypes.c_float(1.0 / size)
             c.limit = limit;
             c.scale = reinterpret_cast<ScaleFn>(scale);
             c.step = step;
             c.at_end = at_end;
             c.bf16 = bf16;
             c.merge = merge;
             c.on.store(true);
           },
           "From the next bucket on, every bucket is averaged here (call between steps); at_end: each step's end "
           "in Python once it has completed, not at its last launch; bf16: the averages travel in bf16; merge: each "
           "bucket first takes its residuals (native.merge).")
      .def("disable", [](Control& c) { c.on.store(false); }, "From the next bucket on, terngrad_hook averages.")
      .def_property_readonly("on", [](const Control& c) { return c.on.load(); });
  m.def("register", &register_hook,
        "The hook on a DDP model's reducer (native: a weakref to ddp.native.Native); returns its Control, off.");
}
