// Package inbox makes consumers apply each event's side effect exactly once,
// and handles SQS FIFO batches the way Lambda's event source expects.
//
// Process claims (consumer, event id) in the inbox table and runs the side
// effect in the same transaction: a duplicate delivery (SQS redelivery,
// redrive, replay) finds the claim and commits nothing; a failure rolls back
// both. Handler turns an events.SQSEvent into an events.SQSEventResponse with
// FIFO-correct partial batch failures, and Runner is a local stand-in for the
// Lambda SQS event source.
package inbox
