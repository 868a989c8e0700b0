// Reached through -isystem (CMake: SYSTEM include directory): a -MMD depfile leaves it out.
#pragma once
#define DEMO_SUM_START 0
