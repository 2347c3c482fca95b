"""Hot ops behind one interface each, the reference beside the fast path; the backend picks."""
