// xent_dist_bench: the host and CUDA devices (buffers, timers, copy bandwidth).
#include "device.h"

#include <mpi.h>
#include <unistd.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "reference.h"

namespace xb {

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(e) + " (" +
                             cudaGetErrorString(e) + ")");
}

namespace {

class HostDevice final : public Device {
 public:
  bool gpu() const override { return false; }
  void* alloc(size_t bytes) override {
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p)
      throw std::runtime_error("out of host memory allocating " + std::to_string(bytes) + " bytes");
    std::memset(p, 0, rounded);  // commit the pages now, not inside a timed call
    return p;
  }
  void release(void* p) override { std::free(p); }
  void upload(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void zero(void* p, size_t bytes) override { std::memset(p, 0, bytes); }
  void fill_logits(const Problem& p, void* data) override { host_fill_logits(p, data); }
  void sync() override {}
  int64_t memory_in_use() override {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
    const struct mallinfo2 m = mallinfo2();
    return static_cast<int64_t>(m.uordblks + m.hblkhd);
#else
    return 0;
#endif
  }
  int64_t memory_available(std::string* how) override {
    // MemAvailable counts the page cache the kernel can drop, unlike free pages; Linux 3.14+.
    std::FILE* f = std::fopen("/proc/meminfo", "r");
    long long kib = -1;
    if (f) {
      char line[256];
      while (std::fgets(line, sizeof line, f))
        if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
      std::fclose(f);
    }
    if (kib >= 0) {
      if (how) *how = "host memory available (MemAvailable in /proc/meminfo)";
      return static_cast<int64_t>(kib) * 1024;
    }
    if (how) *how = "free host memory (sysconf _SC_AVPHYS_PAGES)";
    return static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  }
  double copy_bandwidth(std::string* how) override {
    const size_t bytes = size_t(64) << 20;
    std::vector<char> a(bytes, 1), b(bytes, 2);
    double best = 0.0;
    for (int i = 0; i < 6; ++i) {
      const double t0 = MPI_Wtime();
      std::memcpy(b.data(), a.data(), bytes);
      const double t = MPI_Wtime() - t0;
      a[static_cast<size_t>(i)] =
          b[bytes - 1 - static_cast<size_t>(i)];  // keep the copy observable
      if (i > 0 && t > 0) best = std::max(best, 2.0 * static_cast<double>(bytes) / t);
    }
    if (how) *how = "memcpy of 64 MiB on the host, read + written, best of 5";
    return best;
  }
  void marks(int n) override {
    t_.assign(static_cast<size_t>(n), 0.0);
  }
  void mark(int i) override {
    t_.at(static_cast<size_t>(i)) = MPI_Wtime();
  }
  double ms(int a, int b) override {
    return 1e3 * (t_.at(static_cast<size_t>(b)) - t_.at(static_cast<size_t>(a)));
  }

 private:
  std::vector<double> t_;
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int device) : device_(device) {
    cuda_ok(cudaSetDevice(device), "cudaSetDevice");
    cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~CudaDevice() override {
    for (cudaEvent_t e : ev_) cudaEventDestroy(e);
    if (stream_) cudaStreamDestroy(stream_);
  }
  bool gpu() const override { return true; }
  void* alloc(size_t bytes) override {
    void* p = nullptr;
    cuda_ok(cudaMalloc(&p, bytes), ("cudaMalloc of " + std::to_string(bytes) + " bytes").c_str());
    return p;
  }
  void release(void* p) override {
    cudaStreamSynchronize(stream_);
    cudaFree(p);
  }
  void upload(void* dst, const void* src, size_t bytes) override {
    cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_),
            "cudaMemcpyAsync (to device)");
    sync();  // the host source may go away
  }
  void download(void* dst, const void* src, size_t bytes) override {
    cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_),
            "cudaMemcpyAsync (to host)");
    sync();
  }
  void zero(void* p, size_t bytes) override {
    cuda_ok(cudaMemsetAsync(p, 0, bytes, stream_), "cudaMemsetAsync");
  }
  void fill_logits(const Problem& p, void* data) override { cuda_fill_logits(p, data, stream_); }
  void sync() override { cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
  int64_t memory_in_use() override {
    size_t free_b = 0, total = 0;
    cuda_ok(cudaMemGetInfo(&free_b, &total), "cudaMemGetInfo");
    return static_cast<int64_t>(total) - static_cast<int64_t>(free_b);
  }
  int64_t memory_available(std::string* how) override {
    size_t free_b = 0, total = 0;
    cuda_ok(cudaMemGetInfo(&free_b, &total), "cudaMemGetInfo");
    if (how) *how = "free memory on GPU " + std::to_string(device_) + " (cudaMemGetInfo)";
    return static_cast<int64_t>(free_b);
  }
  double copy_bandwidth(std::string* how) override {
    size_t bytes = size_t(1) << 30;
    void *a = nullptr, *b = nullptr;
    while (bytes >= (size_t(64) << 20)) {  // 1 GiB, less where the GPU has less free
      if (cudaMalloc(&a, bytes) == cudaSuccess) {
        if (cudaMalloc(&b, bytes) == cudaSuccess) break;
        cudaFree(a);
        a = nullptr;
      }
      cudaGetLastError();
      bytes /= 2;
    }
    if (!a || !b)
      throw std::runtime_error("cannot allocate 2 x 64 MiB to measure the copy bandwidth");
    cuda_ok(cudaMemsetAsync(a, 1, bytes, stream_), "cudaMemsetAsync");
    marks(2);
    double best = 0.0;
    for (int i = 0; i < 12; ++i) {
      mark(0);
      cuda_ok(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream_),
              "cudaMemcpyAsync (device to device)");
      mark(1);
      sync();
      const double t = ms(0, 1) * 1e-3;
      if (i >= 2 && t > 0) best = std::max(best, 2.0 * static_cast<double>(bytes) / t);
    }
    cudaFree(a);
    cudaFree(b);
    if (how) {
      *how = "cudaMemcpy device to device of " +
             (bytes >= (size_t(1) << 30) ? std::to_string(bytes >> 30) + " GiB"
                                         : std::to_string(bytes >> 20) + " MiB") +
             ", read + written, best of 10";
    }
    return best;
  }
  void marks(int n) override {
    while (static_cast<int>(ev_.size()) < n) {
      cudaEvent_t e;
      cuda_ok(cudaEventCreate(&e), "cudaEventCreate");
      ev_.push_back(e);
    }
  }
  void mark(int i) override {
    cuda_ok(cudaEventRecord(ev_.at(static_cast<size_t>(i)), stream_), "cudaEventRecord");
  }
  double ms(int a, int b) override {
    float t = 0.0f;
    cuda_ok(
        cudaEventElapsedTime(&t, ev_.at(static_cast<size_t>(a)), ev_.at(static_cast<size_t>(b))),
        "cudaEventElapsedTime");
    return t;
  }

 private:
  int device_;
  std::vector<cudaEvent_t> ev_;
};

}  // namespace

std::unique_ptr<Device> make_host_device() {
  return std::make_unique<HostDevice>();
}
std::unique_ptr<Device> make_cuda_device(int device) {
  return std::make_unique<CudaDevice>(device);
}

}  // namespace xb
