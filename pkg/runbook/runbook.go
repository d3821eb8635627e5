// Package runbook holds the fifobox commands that alarms and runbooks tell
// an operator to run, in one place: the CDK app writes them into the
// alarms' descriptions (infra/stacks/alarms.go), docs/operations.md shows
// them, and a test of the app module parses every one with the CLI's own
// command table (docs/commands_test.go), so a renamed command or flag, or
// a missing required one, fails a test instead of misleading someone at
// night.
//
// A command is a CLI line starting "fifobox "; "<consumer>" stands for the
// alarm's consumer, and the other <...> for values the operator chooses.
package runbook

import "strings"

// The steps, each a list of commands run in order.
var (
	// PublishRetrying: publishing fails and aggregates back off.
	PublishRetrying = []string{"fifobox status", "fifobox retry-now"}
	// StrandedEvents: pending events no claim reaches (written around the
	// enqueue path): derive their heads so the dispatcher publishes them.
	StrandedEvents = []string{"fifobox status", "fifobox repair-heads"}
	// DeadEvents: outbox events went dead (and park their aggregates).
	DeadEvents = []string{"fifobox dead list", "fifobox dead requeue --event-id <event-id>"}
	// DLQMessages: a consumer's DLQ holds messages.
	DLQMessages = []string{"fifobox dlq list --consumer <consumer>", "fifobox redrive --consumer <consumer>"}
	// SubscriptionDLQMessages: SNS could not deliver to the consumer's
	// queue; the events wait in its subscription's DLQ (a plain redrive,
	// from the consumer queue's DLQ, would move none of them).
	SubscriptionDLQMessages = []string{"fifobox dlq list --consumer <consumer> --from subscription-dlq",
		"fifobox redrive --consumer <consumer> --from subscription-dlq"}
	// DeliveryLost: SNS could neither deliver nor dead-letter: replay the
	// window from the outbox to that consumer.
	DeliveryLost = []string{"fifobox replay --consumer <consumer> --aggregate-type <aggregate-type> --since <time>"}
	// OperationsErrors: an operation failed; the audit says which.
	OperationsErrors = []string{"fifobox audit"}
)

// All are every step by name, for the tests and the docs.
var All = map[string][]string{
	"PublishRetrying":         PublishRetrying,
	"DeadEvents":              DeadEvents,
	"StrandedEvents":          StrandedEvents,
	"DLQMessages":             DLQMessages,
	"SubscriptionDLQMessages": SubscriptionDLQMessages,
	"DeliveryLost":            DeliveryLost,
	"OperationsErrors":        OperationsErrors,
}

// Text renders a step for an alarm description: each command in
// backquotes, "then" between them, <consumer> filled in when consumer is
// not empty.
func Text(step []string, consumer string) string {
	parts := make([]string, len(step))
	for i, c := range step {
		if consumer != "" {
			c = strings.ReplaceAll(c, "<consumer>", consumer)
		}
		parts[i] = "`" + c + "`"
	}
	return strings.Join(parts, ", then ")
}
