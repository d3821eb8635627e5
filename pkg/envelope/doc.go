// Package envelope defines the event envelope (version 1) that every part of
// fifobox shares: the producer's Enqueue, the dispatcher's SNS message, and the
// consumer's inbox. It does no I/O.
//
// An Envelope is validated strictly before it is written: every problem is a
// *ValidationError naming the offending field, so bad input is refused at the
// boundary instead of being discovered by SNS (or a consumer) later.
//
// Trace context travels in the W3C traceparent/tracestate fields, injected and
// extracted with OpenTelemetry's TraceContext propagator.
package envelope
