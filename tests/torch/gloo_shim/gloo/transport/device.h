// Test-only stand-in for Gloo's header (see README.md): the tests hold devices by shared_ptr.
#pragma once

namespace gloo::transport {
class Device;
class UnboundBuffer;
}  // namespace gloo::transport
