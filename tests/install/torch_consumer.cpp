// Links against the installed xent::torch alone and checks one loss and its gradient on CPU
// tensors with a null process group (one rank): two rows of three classes, the mean of
// logsumexp(1, 2, 3) - 3 and log(3), and the gradient (softmax - one_hot) / 2.
#include <xent/torch.h>

#include <cmath>
#include <cstdio>

int main() {
  const float x[2][3] = {{1.0f, 2.0f, 3.0f}, {0.5f, 0.5f, 0.5f}};
  const int64_t t[2] = {2, 1};
  at::Tensor logits =
      at::from_blob(const_cast<float*>(&x[0][0]), {2, 3}, at::kFloat).clone().requires_grad_(true);
  at::Tensor target = at::tensor({t[0], t[1]}, at::kLong);

  xent::torch::CrossEntropyResult r = xent::torch::vocab_parallel_cross_entropy(
      logits, target, c10::intrusive_ptr<c10d::ProcessGroup>());
  r.loss.backward();

  double lse[2], expected = 0.0;
  for (int i = 0; i < 2; ++i) {
    lse[i] =
        std::log(std::exp(double(x[i][0])) + std::exp(double(x[i][1])) + std::exp(double(x[i][2])));
    expected += (lse[i] - x[i][t[i]]) / 2.0;
  }
  const double loss = r.loss.item<double>();
  std::printf("loss %.7f, expected %.7f\n", loss, expected);
  int bad = std::fabs(loss - expected) < 1e-6 ? 0 : 1;
  at::Tensor grad = logits.grad();
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) {
      const double g = (std::exp(x[i][j] - lse[i]) - (j == t[i] ? 1.0 : 0.0)) / 2.0;
      const double got = grad[i][j].item<double>();
      if (std::fabs(got - g) > 1e-6) {
        std::printf("grad[%d][%d] %.7f, expected %.7f\n", i, j, got, g);
        bad = 1;
      }
    }
  return bad;
}
