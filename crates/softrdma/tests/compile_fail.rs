//! The in-flight guarantees of `softrdma::managed` that the type system enforces: each
//! case is a misuse that must not compile, with the compiler's error kept beside it.

#[test]
fn misuses_of_buffers_in_flight_do_not_compile() {
    trybuild::TestCases::new().compile_fail("tests/compile_fail/*.rs");
}
