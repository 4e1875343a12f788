// Links against the installed xent and checks one loss on the CPU backend: log(3) for three
// equal logits.
#include <xent/xent.h>

#include <cmath>
#include <cstdio>

int main() {
  float logits[3] = {0.5f, 0.5f, 0.5f};
  int64_t target = 1;
  float loss = 0.0f;
  xent::Group group = xent::Group::local();
  xent::Options opt;
  opt.grad_mode = xent::GradMode::none;
  xent::Outputs out;
  out.loss = &loss;
  xent::forward(group, {logits, xent::DType::f32, 1, 3, 3}, {&target, xent::IndexType::i64, 1}, opt,
                out);
  std::printf("loss %.7f, expected %.7f\n", loss, std::log(3.0));
  return std::fabs(loss - std::log(3.0f)) < 1e-6f ? 0 : 1;
}
