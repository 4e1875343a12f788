// Links against the installed xent::mpi and checks one loss on the CPU backend over MPI (one
// rank, a singleton MPI_Init): log(3) for three equal logits.
#include <xent/mpi.h>

#include <cmath>
#include <cstdio>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  float logits[3] = {0.5f, 0.5f, 0.5f};
  int64_t target = 1;
  float loss = 0.0f;
  xent::Group group = xent::mpi::host_group(MPI_COMM_WORLD);
  xent::Options opt;
  opt.grad_mode = xent::GradMode::none;
  xent::Outputs out;
  out.loss = &loss;
  xent::forward(group, {logits, xent::DType::f32, 1, 3, 3}, {&target, xent::IndexType::i64, 1}, opt,
                out);
  std::printf("loss %.7f over MPI, expected %.7f\n", loss, std::log(3.0));
  MPI_Finalize();
  return std::fabs(loss - std::log(3.0f)) < 1e-6f ? 0 : 1;
}
