// Package topology is the single definition of fifobox's messaging layout:
// the SNS FIFO topic, and per consumer an SQS FIFO queue, its FIFO dead-letter
// queue and the subscription filter. The CDK app (infra/) and the local
// bootstrapper both read it, so the cloud and local setups cannot drift.
package topology

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// Topology is the topic and the consumers subscribed to it.
type Topology struct {
	// Topic is the SNS FIFO topic the dispatcher publishes to.
	Topic Topic
	// Consumers each get a queue, a DLQ and a subscription.
	Consumers []Consumer
}

// Topic describes the SNS FIFO topic.
type Topic struct {
	// Name must end in ".fifo".
	Name string
	// ThroughputScope is "MessageGroup" (high-throughput mode) or "Topic".
	ThroughputScope string
}

// Consumer describes one subscriber: its queue, DLQ and filter.
type Consumer struct {
	// Name identifies the consumer; it is also its inbox key. Letters, digits, '-' and '_'.
	Name string
	// MaxRetries is the event's own retry budget: how many times its side
	// effect may fail (counted per event by the consumer engine, durably)
	// before the consumer dead-letters it. Redeliveries that were not its
	// failures (the database unreachable, a consumer killed, a deadline)
	// never spend it. 1-50; 0: DefaultMaxRetries, or MaxReceiveCount-1
	// when that is smaller.
	MaxRetries int
	// MaxReceiveCount is the SQS redrive policy's maxReceiveCount: how
	// often SQS delivers a message before it moves it to the DLQ itself,
	// whatever the consumer recorded. It is a backstop for a consumer that
	// never gets to record anything (every delivery crashing it), far above
	// MaxRetries+1 so that infrastructure failures and redeliveries cannot
	// run a healthy event into it. 1-1000, more than MaxRetries; 0:
	// DefaultMaxReceiveCount.
	MaxReceiveCount int
	// VisibilityTimeoutSeconds for the queue; in AWS at least 6x the function timeout.
	VisibilityTimeoutSeconds int
	// FunctionTimeoutSeconds of the consumer Lambda.
	FunctionTimeoutSeconds int
	// MaxConcurrency of the Lambda event source mapping (2-1000).
	MaxConcurrency int
	// Filter maps message attribute names to allowed values; empty means every event.
	Filter map[string][]string
	// RelaxedOrder opts the consumer out of strict per-aggregate order.
	// Strict (false, the default): once the consumer dead-letters an event,
	// it sends the aggregate's later events to its DLQ behind it until
	// redrive brings them back in order. Relaxed: later events are applied
	// at once, and the dead one arrives after them when redriven (for side
	// effects that do not depend on order). The consumer function gets it
	// as FIFOBOX_CONSUMER_ORDER (OrderName).
	RelaxedOrder bool
	// Delivery is how SNS hands a message to the queue: "" or DeliveryRaw
	// (the body is the message, what fifobox's consumers read) or
	// DeliverySNS (SNS's JSON notification, the message in its "Message"
	// member, for consumers written that way; a wire profile chooses it).
	Delivery string `json:",omitempty"`
}

// Defaults of Consumer's retry budget and redelivery backstop.
const (
	DefaultMaxRetries      = 4
	DefaultMaxReceiveCount = 100
)

// Retries is MaxRetries, or when it is 0 DefaultMaxRetries (at most
// ReceiveLimit()-1: a topology that sets only a small maxReceiveCount
// keeps the budget it had).
func (c Consumer) Retries() int {
	if c.MaxRetries == 0 {
		return max(min(DefaultMaxRetries, c.ReceiveLimit()-1), 0)
	}
	return c.MaxRetries
}

// ReceiveLimit is MaxReceiveCount, or DefaultMaxReceiveCount when it is 0.
func (c Consumer) ReceiveLimit() int {
	if c.MaxReceiveCount == 0 {
		return DefaultMaxReceiveCount
	}
	return c.MaxReceiveCount
}

// Delivery styles of a subscription.
const (
	DeliveryRaw = "raw"
	DeliverySNS = "sns"
)

// RawDelivery reports whether the subscription delivers raw messages.
func (c Consumer) RawDelivery() bool { return c.Delivery != DeliverySNS }

// OrderName is the consumer's order setting as FIFOBOX_CONSUMER_ORDER
// spells it: "strict" or "relaxed".
func (c Consumer) OrderName() string {
	if c.RelaxedOrder {
		return "relaxed"
	}
	return "strict"
}

// DLQRetention is how long every DLQ keeps a message: 14 days, the SQS
// maximum (time to investigate). Inbox rows must outlast it
// (inbox.MinRetention), or a redriven message could be applied twice.
const DLQRetention = 14 * 24 * time.Hour

// QueueName is the consumer's SQS FIFO queue name.
func (c Consumer) QueueName() string { return c.Name + ".fifo" }

// DLQName is the consumer's FIFO dead-letter queue name.
func (c Consumer) DLQName() string { return c.Name + "-dlq.fifo" }

// SubscriptionDLQName is the FIFO dead-letter queue of the consumer's SNS
// subscription: messages SNS could not deliver to the consumer's queue (a
// disabled KMS key, a changed queue policy, a deleted queue) land here
// instead of being dropped. `fifobox redrive` moves them to the consumer's
// queue in group order.
func (c Consumer) SubscriptionDLQName() string { return c.Name + "-sub-dlq.fifo" }

// FilterPolicy returns the SNS subscription filter policy JSON, or "" for none.
func (c Consumer) FilterPolicy() string {
	if len(c.Filter) == 0 {
		return ""
	}
	b, _ := json.Marshal(c.Filter) // map[string][]string always marshals
	return string(b)
}

// Matches reports whether an event with the given attributes passes the filter
// (exact string match, as an SNS filter policy with string values does).
func (c Consumer) Matches(attrs map[string]string) bool {
	for k, allowed := range c.Filter {
		v, ok := attrs[k]
		if !ok {
			return false
		}
		found := false
		for _, a := range allowed {
			if a == v {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// Consumer returns the consumer with the given name.
func (t Topology) Consumer(name string) (Consumer, bool) {
	for _, c := range t.Consumers {
		if c.Name == name {
			return c, true
		}
	}
	return Consumer{}, false
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,70}$`)

// Validate checks names, limits and filters against AWS rules.
func (t Topology) Validate() error {
	var errs []error
	if !strings.HasSuffix(t.Topic.Name, ".fifo") || !nameRE.MatchString(strings.TrimSuffix(t.Topic.Name, ".fifo")) {
		errs = append(errs, fmt.Errorf("topic.name %q: must be letters, digits, '-' or '_' and end in .fifo", t.Topic.Name))
	}
	if t.Topic.ThroughputScope != "MessageGroup" && t.Topic.ThroughputScope != "Topic" {
		errs = append(errs, fmt.Errorf("topic.throughput_scope %q: must be MessageGroup or Topic", t.Topic.ThroughputScope))
	}
	if len(t.Consumers) == 0 {
		errs = append(errs, errors.New("consumers: at least one consumer is required"))
	}
	seen := map[string]bool{}
	for i, c := range t.Consumers {
		p := fmt.Sprintf("consumers[%d]", i)
		if !nameRE.MatchString(c.Name) {
			errs = append(errs, fmt.Errorf("%s.name %q: must be 1-70 letters, digits, '-' or '_'", p, c.Name))
		}
		if seen[c.Name] {
			errs = append(errs, fmt.Errorf("%s.name %q: duplicate", p, c.Name))
		}
		seen[c.Name] = true
		if c.MaxRetries < 0 || c.MaxRetries > 50 {
			errs = append(errs, fmt.Errorf("%s.max_retries %d: must be 1-50 (0: %d)", p, c.MaxRetries, DefaultMaxRetries))
		}
		if c.MaxReceiveCount < 0 || c.MaxReceiveCount > 1000 {
			errs = append(errs, fmt.Errorf("%s.max_receive_count %d: must be 1-1000 (0: %d)", p, c.MaxReceiveCount, DefaultMaxReceiveCount))
		} else if c.MaxRetries > 0 && c.ReceiveLimit() <= c.MaxRetries {
			errs = append(errs, fmt.Errorf("%s.max_receive_count %d: must exceed max_retries (%d): SQS would dead-letter an event before its retries are spent",
				p, c.ReceiveLimit(), c.Retries()))
		}
		if c.FunctionTimeoutSeconds < 1 || c.FunctionTimeoutSeconds > 900 {
			errs = append(errs, fmt.Errorf("%s.function_timeout_seconds %d: must be 1-900", p, c.FunctionTimeoutSeconds))
		}
		if c.VisibilityTimeoutSeconds < 6*c.FunctionTimeoutSeconds || c.VisibilityTimeoutSeconds > 43200 {
			errs = append(errs, fmt.Errorf("%s.visibility_timeout_seconds %d: must be at least 6x the function timeout (%d) and at most 43200",
				p, c.VisibilityTimeoutSeconds, 6*c.FunctionTimeoutSeconds))
		}
		if c.MaxConcurrency < 2 || c.MaxConcurrency > 1000 {
			errs = append(errs, fmt.Errorf("%s.max_concurrency %d: must be 2-1000", p, c.MaxConcurrency))
		}
		if c.Delivery != "" && c.Delivery != DeliveryRaw && c.Delivery != DeliverySNS {
			errs = append(errs, fmt.Errorf("%s.delivery %q: must be raw or sns", p, c.Delivery))
		}
		keys := make([]string, 0, len(c.Filter))
		for k := range c.Filter {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			switch k {
			case envelope.AttrEventType, envelope.AttrAggregateType, envelope.AttrTenantID:
			default:
				errs = append(errs, fmt.Errorf("%s.filter[%q]: not a published message attribute", p, k))
			}
			if len(c.Filter[k]) == 0 {
				errs = append(errs, fmt.Errorf("%s.filter[%q]: needs at least one value", p, k))
			}
		}
	}
	return errors.Join(errs...)
}

// Default is the topology fifobox ships with: one topic and three example
// consumers (a read model of orders, shipping reacting to payments, and an
// audit log of everything).
func Default() Topology {
	return Topology{
		Topic: Topic{Name: "fifobox-events.fifo", ThroughputScope: "MessageGroup"},
		Consumers: []Consumer{
			{
				Name: "orders-projection", MaxRetries: DefaultMaxRetries, MaxReceiveCount: DefaultMaxReceiveCount,
				FunctionTimeoutSeconds: 30, VisibilityTimeoutSeconds: 180, MaxConcurrency: 5,
				Filter: map[string][]string{envelope.AttrAggregateType: {"order"}},
			},
			{
				Name: "shipping", MaxRetries: DefaultMaxRetries, MaxReceiveCount: DefaultMaxReceiveCount,
				FunctionTimeoutSeconds: 30, VisibilityTimeoutSeconds: 180, MaxConcurrency: 2,
				Filter: map[string][]string{envelope.AttrEventType: {"order.paid"}},
			},
			{
				Name: "audit", MaxRetries: DefaultMaxRetries, MaxReceiveCount: DefaultMaxReceiveCount,
				FunctionTimeoutSeconds: 30, VisibilityTimeoutSeconds: 180, MaxConcurrency: 2,
			},
		},
	}
}
