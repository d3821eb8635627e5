package amqp

import "github.com/fifobox/fifobox/pkg/inbox"

// Names kept for pkg/lambdafn/consumer until it moves onto inbox's own
// (the SNS/SQS move, issue 26): they are inbox's types, not copies.

// Deprecated: use inbox.ConsumerConfig.
type ConsumerConfig = inbox.ConsumerConfig

// Deprecated: use inbox.Settlement.
type Settlement = inbox.Settlement

// Deprecated: use inbox.ActionApplied and inbox.ActionDuplicate.
const (
	ActionApplied   = inbox.ActionApplied
	ActionDuplicate = inbox.ActionDuplicate
)
