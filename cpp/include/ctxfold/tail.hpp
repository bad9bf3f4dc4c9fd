// Tail selection over segments and over raw token ids (issue: tail selection and boundary alignment).
#pragma once
