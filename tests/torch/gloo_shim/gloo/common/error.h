// Test-only stand-in for Gloo's header (see README.md): nothing of it is needed.
#pragma once
