package nats

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/pkg/transport"
)

// Provisioner creates a topology's streams and consumers.
type Provisioner struct {
	cfg Config
}

var _ transport.Provisioner = (*Provisioner)(nil)

// NewProvisioner returns a Provisioner for cfg's topology.
func NewProvisioner(cfg Config) (*Provisioner, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new nats provisioner: %w", err)
	}
	return &Provisioner{cfg: cfg}, nil
}

// ErrTopologyConflict is returned (wrapped, with every difference named)
// when a stream or consumer exists with other settings than the topology's.
// Provision never changes or deletes what exists: update the entity by hand
// (nats stream edit / nats consumer edit, after checking the change is
// safe) or change the topology back.
var ErrTopologyConflict = errors.New("nats: an existing stream or consumer has other settings than the topology")

// Provision creates, in order: the events stream, the dead-letter stream,
// and per consumer its durable pull consumer. One that exists with the
// topology's settings is left alone, so Provision is safe to run on every
// deploy or start; one that exists with other settings is reported (all
// differences, in one ErrTopologyConflict) and left as it is.
//
// On servers before 2.10 a consumer has one filter subject at most, so each
// consumer is created without one (it reads the whole stream) and its runner
// skips what its filters do not select; from 2.10 the server filters.
func (p *Provisioner) Provision(ctx context.Context) error {
	nc, err := p.cfg.dial("provisioner")
	if err != nil {
		return fmt.Errorf("provision: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("provision: %w", err)
	}
	t := &p.cfg.Topology
	var conflicts []string
	stream, diff, err := ensureStream(ctx, js, t.streamConfig())
	if err != nil {
		return fmt.Errorf("provision stream %s: %w", t.Stream, err)
	}
	conflicts = append(conflicts, diff...)
	if _, diff, err = ensureStream(ctx, js, t.deadLetterStreamConfig()); err != nil {
		return fmt.Errorf("provision dead-letter stream %s: %w", t.DeadLetterStream, err)
	}
	conflicts = append(conflicts, diff...)
	multi := multiFilter(nc)
	for _, c := range t.Consumers {
		diff, err := ensureConsumer(ctx, stream, t.consumerConfig(c, multi))
		if err != nil {
			return fmt.Errorf("provision consumer %s on %s: %w", c.Durable(), t.Stream, err)
		}
		conflicts = append(conflicts, diff...)
	}
	if len(conflicts) > 0 {
		return fmt.Errorf("provision: %w: %s", ErrTopologyConflict, strings.Join(conflicts, "; "))
	}
	p.cfg.Logger.Info("nats: topology provisioned", "stream", t.Stream, "dead_letter_stream", t.DeadLetterStream,
		"consumers", len(t.Consumers), "server_filters", multi)
	return nil
}

// streamConfig is the events stream. Discard-new: a full stream refuses a
// publish (retryable) instead of dropping its oldest, possibly unconsumed,
// events.
func (t *Topology) streamConfig() jetstream.StreamConfig {
	ret := jetstream.InterestPolicy
	if t.Retention == RetentionLimits {
		ret = jetstream.LimitsPolicy
	}
	return jetstream.StreamConfig{
		Name:        t.Stream,
		Description: "fifobox events (" + t.SubjectPrefix + ")",
		Subjects:    t.StreamSubjects(),
		Retention:   ret,
		Discard:     jetstream.DiscardNew,
		MaxAge:      time.Duration(t.MaxAge),
		MaxBytes:    orUnlimited(t.MaxBytes),
		MaxMsgSize:  t.MaxMsgSize,
		MaxMsgs:     -1,
		Storage:     storageType(t.Storage),
		Replicas:    t.Replicas,
		Duplicates:  time.Duration(t.DuplicateWindow),
	}
}

// deadLetterStreamConfig keeps dead letters for DeadLetterMaxAge.
func (t *Topology) deadLetterStreamConfig() jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:        t.DeadLetterStream,
		Description: "fifobox dead letters (" + t.SubjectPrefix + ")",
		Subjects:    t.DeadLetterSubjects(),
		Retention:   jetstream.LimitsPolicy,
		Discard:     jetstream.DiscardNew,
		MaxAge:      time.Duration(t.DeadLetterMaxAge),
		MaxBytes:    -1,
		MaxMsgSize:  -1,
		MaxMsgs:     -1,
		Storage:     storageType(t.Storage),
		Replicas:    t.Replicas,
		Duplicates:  2 * time.Minute,
	}
}

// consumerConfig is c's durable pull consumer. The server's BackOff list is
// not used: it replaces AckWait for every delivery's first timeout, while
// the retry delays come from NakWithDelay (transport.RetryPolicy).
func (t *Topology) consumerConfig(c Consumer, multi bool) jetstream.ConsumerConfig {
	cc := jetstream.ConsumerConfig{
		Durable:       c.Durable(),
		Description:   "fifobox consumer " + c.Name,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       time.Duration(c.AckWait),
		MaxDeliver:    c.MaxDeliver,
		MaxAckPending: c.MaxAckPending,
		ReplayPolicy:  jetstream.ReplayInstantPolicy,
	}
	if multi {
		cc.FilterSubjects = t.FilterSubjects(c)
	}
	return cc
}

func storageType(s string) jetstream.StorageType {
	if s == StorageMemory {
		return jetstream.MemoryStorage
	}
	return jetstream.FileStorage
}

func orUnlimited(n int64) int64 {
	if n <= 0 {
		return -1
	}
	return n
}

// ensureStream creates want, or compares it with the existing stream.
func ensureStream(ctx context.Context, js jetstream.JetStream, want jetstream.StreamConfig) (jetstream.Stream, []string, error) {
	s, err := js.Stream(ctx, want.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		s, err = js.CreateStream(ctx, want)
		if err != nil {
			return nil, nil, fmt.Errorf("create: %w", err)
		}
		return s, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("look up: %w", err)
	}
	return s, streamDiff(s.CachedInfo().Config, want), nil
}

// streamDiff names the settings of have that differ from want.
func streamDiff(have, want jetstream.StreamConfig) []string {
	var d []string
	add := func(field string, h, w any) {
		d = append(d, fmt.Sprintf("stream %s %s is %v, topology wants %v", want.Name, field, h, w))
	}
	if !sameSet(have.Subjects, want.Subjects) {
		add("subjects", have.Subjects, want.Subjects)
	}
	if have.Retention != want.Retention {
		add("retention", have.Retention, want.Retention)
	}
	if have.Discard != want.Discard {
		add("discard", have.Discard, want.Discard)
	}
	if have.Storage != want.Storage {
		add("storage", have.Storage, want.Storage)
	}
	if have.Replicas != want.Replicas {
		add("replicas", have.Replicas, want.Replicas)
	}
	if have.MaxAge != want.MaxAge {
		add("max_age", have.MaxAge, want.MaxAge)
	}
	if orUnlimited(have.MaxBytes) != orUnlimited(want.MaxBytes) {
		add("max_bytes", have.MaxBytes, want.MaxBytes)
	}
	if orUnlimited(int64(have.MaxMsgSize)) != orUnlimited(int64(want.MaxMsgSize)) {
		add("max_msg_size", have.MaxMsgSize, want.MaxMsgSize)
	}
	if have.Duplicates != want.Duplicates {
		add("duplicate_window", have.Duplicates, want.Duplicates)
	}
	return d
}

// ensureConsumer creates want on s, or compares it with the existing one.
// It looks first rather than calling create: servers before 2.10 apply a
// create with other settings as an update, silently.
func ensureConsumer(ctx context.Context, s jetstream.Stream, want jetstream.ConsumerConfig) ([]string, error) {
	c, err := s.Consumer(ctx, want.Durable)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		if _, err := s.CreateConsumer(ctx, want); err != nil {
			return nil, fmt.Errorf("create: %w", err)
		}
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("look up: %w", err)
	}
	return consumerDiff(c.CachedInfo().Config, want), nil
}

func consumerDiff(have, want jetstream.ConsumerConfig) []string {
	var d []string
	add := func(field string, h, w any) {
		d = append(d, fmt.Sprintf("consumer %s %s is %v, topology wants %v", want.Durable, field, h, w))
	}
	hf, wf := filters(have), filters(want)
	if !sameSet(hf, wf) {
		add("filter subjects", hf, wf)
	}
	if have.AckPolicy != want.AckPolicy {
		add("ack_policy", have.AckPolicy, want.AckPolicy)
	}
	if have.DeliverPolicy != want.DeliverPolicy {
		add("deliver_policy", have.DeliverPolicy, want.DeliverPolicy)
	}
	if have.AckWait != want.AckWait {
		add("ack_wait", have.AckWait, want.AckWait)
	}
	if have.MaxDeliver != want.MaxDeliver {
		add("max_deliver", have.MaxDeliver, want.MaxDeliver)
	}
	if have.MaxAckPending != want.MaxAckPending {
		add("max_ack_pending", have.MaxAckPending, want.MaxAckPending)
	}
	if have.DeliverSubject != "" {
		add("deliver_subject (a push consumer)", have.DeliverSubject, "none (pull)")
	}
	return d
}

func filters(c jetstream.ConsumerConfig) []string {
	if len(c.FilterSubjects) > 0 {
		return c.FilterSubjects
	}
	if c.FilterSubject != "" {
		return []string{c.FilterSubject}
	}
	return nil
}

func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}
