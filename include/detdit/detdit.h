// detdit: umbrella header of the public C++ API.
#pragma once

#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_layernorm.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/layernorm.h"
#include "detdit/linear.h"
#include "detdit/memory.h"
#include "detdit/numerics.h"
#include "detdit/plan.h"
#include "detdit/rmsnorm.h"
#include "detdit/status.h"
#include "detdit/tensor.h"
#include "detdit/timestep.h"
