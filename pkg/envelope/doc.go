// Package envelope defines the event envelope (version 1) that every part of
// fifobox shares: the producer's Enqueue, the dispatcher's SNS message, and the
// consumer's inbox. It does no I/O.
//
// An Envelope is validated strictly before it is written: every problem is a
// *ValidationError naming the offending field, so bad input is refused at the
// boundary instead of being discovered by SNS (or a consumer) later. The rule
// is that whatever Validate accepts, Encode writes and Decode reads back
// unchanged (payload compacted, occurred_at in UTC), in any consumer:
//
//   - id: a UUID in canonical 8-4-4-4-12 form (either case).
//   - type: 1-MaxTypeLen characters, letters, digits and . _ - : /
//     aggregate_type: the same, 1-MaxAggregateTypeLen.
//   - occurred_at: required; its UTC year within MinOccurredYear-MaxOccurredYear
//     (RFC 3339 has four-digit years; PostgreSQL has no year 0). Go's zero
//     time (0001-01-01T00:00:00Z) counts as missing.
//   - aggregate_id (the SNS message group), correlation_id, causation_id:
//     1-MaxGroupIDLen ASCII letters, digits or punctuation, as SNS FIFO
//     requires; the last two optional.
//   - sequence: not negative (0 until the outbox assigns it).
//   - tenant_id: optional, at most MaxTenantIDLen characters of printable
//     UTF-8. traceparent/tracestate: W3C trace context, tracestate only
//     with traceparent.
//   - schema_version: 1-MaxSchemaVersion.
//   - payload: any JSON value except null (a nil Go payload marshals to null:
//     use struct{}{} or {} for an event without data); valid UTF-8 (SNS
//     requires it); no \u0000 and no unpaired surrogate escapes in strings
//     (PostgreSQL jsonb and strict decoders refuse them); every number within
//     a 64-bit float's range; nested at most MaxPayloadDepth arrays and
//     objects deep (the message then nests at most 33 deep, which every
//     mainstream decoder reads with its default limit); no object with two
//     members of the same name (JSON readers disagree on which one wins).
//   - size: the published message (body plus message attributes) at most
//     DefaultMaxMessageBytes, or the limit given to ValidateWithLimit, sized
//     with the widest sequence while the sequence is unassigned.
//
// testdata/validation.json lists valid and invalid cases with the field each
// names; any other implementation of these rules should pass it too.
//
// Decode is as strict, so every consumer reads a message the same way: the
// body must be valid UTF-8, member names match exactly (a member that
// differs from a field name only in case is an error naming that field),
// no member appears twice, and the payload meets the rules above. Unknown
// members are ignored, so newer producers do not break older consumers.
//
// Trace context travels in the W3C traceparent/tracestate fields, injected and
// extracted with OpenTelemetry's TraceContext propagator.
package envelope
