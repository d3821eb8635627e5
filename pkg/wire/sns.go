package wire

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/topology"
)

// SNS is a profile's SNS FIFO section: the topic, how an event's message
// group and deduplication ids are made, its message attributes, and the
// SQS FIFO queues subscribed, each with raw or SNS-envelope delivery.
type SNS struct {
	// Topic is the SNS FIFO topic's name: letters, digits, '-' or '_', and
	// ".fifo" at the end (AWS refuses dots elsewhere).
	Topic string `json:"topic"`
	// ThroughputScope is "MessageGroup" (default, high throughput) or "Topic".
	ThroughputScope string `json:"throughput_scope,omitempty"`
	// GroupID template of MessageGroupId. Default "{aggregate_id}": events of
	// one aggregate are delivered in order.
	GroupID string `json:"group_id,omitempty"`
	// DedupID template of MessageDeduplicationId. Default "{event_id}".
	DedupID string `json:"dedup_id,omitempty"`
	// Attributes are the message attributes (String, or Number for a number
	// field), at most 10 (raw delivery carries no more). Unset: fifobox's
	// own (event_type, aggregate_type, tenant_id, traceparent), which
	// subscription filters match on.
	Attributes map[string]any `json:"attributes,omitempty"`
	// Subscriptions are the consumers' queues.
	Subscriptions []SNSSubscription `json:"subscriptions"`

	group   template
	dedup   template
	headers []header
}

// SNSSubscription is one SQS FIFO queue subscribed to the topic.
type SNSSubscription struct {
	// Name of the consumer; its queue is "<name>.fifo", its DLQ
	// "<name>-dlq.fifo". Letters, digits, '-' and '_'.
	Name string `json:"name"`
	// Delivery is "raw" (the body is the message; fifobox's consumers
	// expect it) or "sns" (the body is SNS's JSON notification and the
	// message is its "Message" member, as consumers that read
	// body['Message'] expect). Default raw.
	Delivery string `json:"delivery,omitempty"`
	// MaxReceiveCount before SQS moves a message to the DLQ itself: a
	// backstop far above the consumer's retry budget (topology.Consumer).
	// Default topology.DefaultMaxReceiveCount (100).
	MaxReceiveCount int `json:"max_receive_count,omitempty"`
	// VisibilityTimeoutSeconds of the queue. Default 60.
	VisibilityTimeoutSeconds int `json:"visibility_timeout_seconds,omitempty"`
	// Filter is an SNS filter policy on the message attributes
	// ({"event_type": ["a", "b"]}); empty: every event.
	Filter map[string][]string `json:"filter,omitempty"`
}

// The delivery styles.
const (
	DeliveryRaw = "raw"
	DeliverySNS = "sns"
)

var (
	snsTopicRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,251}\.fifo$`)
	snsQueueRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,70}$`)
	snsAttrRE  = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,256}$`)
)

func (s *SNS) prepare(at string) []error {
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if !snsTopicRE.MatchString(s.Topic) {
		add("%s.topic %q: letters, digits, '-' or '_', ending in .fifo (AWS allows no other dots)", at, s.Topic)
	}
	if s.ThroughputScope == "" {
		s.ThroughputScope = "MessageGroup"
	}
	if s.ThroughputScope != "MessageGroup" && s.ThroughputScope != "Topic" {
		add("%s.throughput_scope %q: MessageGroup or Topic", at, s.ThroughputScope)
	}
	if s.GroupID == "" {
		s.GroupID = "{aggregate_id}"
	}
	if s.DedupID == "" {
		s.DedupID = "{event_id}"
	}
	var err error
	if s.group, err = parseTemplate(s.GroupID); err != nil {
		add("%s.group_id: %v", at, err)
	}
	if s.dedup, err = parseTemplate(s.DedupID); err != nil {
		add("%s.dedup_id: %v", at, err)
	}
	attrs := s.Attributes
	if attrs == nil {
		attrs = map[string]any{
			envelope.AttrEventType:     "{event_type}",
			envelope.AttrAggregateType: "{aggregate_type}",
			envelope.AttrTenantID:      "{tenant_id}",
			envelope.AttrTraceparent:   "{traceparent}",
		}
	}
	if len(attrs) > 10 {
		add("%s.attributes: %d attributes, raw delivery carries at most 10", at, len(attrs))
	}
	var herrs []error
	s.headers, herrs = compileHeaders(attrs, at+".attributes", snsAttrRE, func(n string) bool {
		l := strings.ToLower(n)
		return strings.HasPrefix(l, "aws.") || strings.HasPrefix(l, "amazon.")
	})
	errs = append(errs, herrs...)
	if len(s.Subscriptions) == 0 {
		add("%s.subscriptions: at least one", at)
	}
	seen := map[string]bool{}
	for i := range s.Subscriptions {
		c := &s.Subscriptions[i]
		p := fmt.Sprintf("%s.subscriptions[%d]", at, i)
		if !snsQueueRE.MatchString(c.Name) {
			add("%s.name %q: 1-70 letters, digits, '-' or '_' (AWS allows no dots in queue names)", p, c.Name)
		}
		if seen[c.Name] {
			add("%s.name %q: twice", p, c.Name)
		}
		seen[c.Name] = true
		if c.Delivery == "" {
			c.Delivery = DeliveryRaw
		}
		if c.Delivery != DeliveryRaw && c.Delivery != DeliverySNS {
			add("%s.delivery %q: raw or sns", p, c.Delivery)
		}
		if c.MaxReceiveCount == 0 {
			c.MaxReceiveCount = topology.DefaultMaxReceiveCount
		}
		if c.MaxReceiveCount < 1 || c.MaxReceiveCount > 1000 {
			add("%s.max_receive_count %d: 1-1000", p, c.MaxReceiveCount)
		}
		if c.VisibilityTimeoutSeconds == 0 {
			c.VisibilityTimeoutSeconds = 60
		}
		if c.VisibilityTimeoutSeconds < 6 || c.VisibilityTimeoutSeconds > 43200 {
			add("%s.visibility_timeout_seconds %d: 6-43200", p, c.VisibilityTimeoutSeconds)
		}
		for _, k := range sortedKeys(c.Filter) {
			if _, ok := attrs[k]; !ok {
				add("%s.filter[%q]: not one of %s.attributes: nothing would match", p, k, at)
			}
		}
	}
	return errs
}

// Topology is the section as fifobox's SNS topology: the topic, and per
// subscription its queue, DLQ, redrive, filter and delivery style, for the
// provisioner and the CDK app. The subscriptions' consumers are not
// fifobox's Lambdas, so the function settings are derived: a timeout that
// fits six times in the visibility timeout, concurrency 2.
func (s *SNS) Topology() topology.Topology {
	t := topology.Topology{Topic: topology.Topic{Name: s.Topic, ThroughputScope: s.ThroughputScope}}
	for _, c := range s.Subscriptions {
		t.Consumers = append(t.Consumers, topology.Consumer{
			Name: c.Name, MaxReceiveCount: c.MaxReceiveCount, VisibilityTimeoutSeconds: c.VisibilityTimeoutSeconds,
			FunctionTimeoutSeconds: max(c.VisibilityTimeoutSeconds/6, 1), MaxConcurrency: 2,
			Filter: c.Filter, Delivery: c.Delivery,
		})
	}
	return t
}
