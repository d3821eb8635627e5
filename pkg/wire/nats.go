package wire

import (
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/fifobox/fifobox/pkg/transport"
)

// NATS is a profile's NATS JetStream section: the subject each event is
// published on, its headers, and the stream that captures the subjects.
type NATS struct {
	// Subject template of the whole subject, e.g. "{event_type}" (a dotted
	// type stays dotted: "subscription.created"). Required.
	Subject string `json:"subject"`
	// MsgID template of Nats-Msg-Id, JetStream's deduplication id.
	// Default "{event_id}".
	MsgID string `json:"msg_id,omitempty"`
	// Headers maps header names to templates or literal numbers and bools.
	Headers map[string]any `json:"headers,omitempty"`
	// Stream captures the subjects.
	Stream NATSStream `json:"stream"`

	subject template
	msgID   template
	headers []header
}

// NATSStream is the stream to create (or find).
type NATSStream struct {
	Name string `json:"name"`
	// Subjects the stream captures, e.g. ["subscription.>", "invoice.>"].
	Subjects []string `json:"subjects"`
	// Storage is "file" (default) or "memory".
	Storage string `json:"storage,omitempty"`
	// Retention is "limits" (default), "interest" or "workqueue".
	Retention string `json:"retention,omitempty"`
	// Replicas, default 1.
	Replicas int `json:"replicas,omitempty"`
	// MaxAge, if set, drops messages older than this.
	MaxAge transport.Duration `json:"max_age,omitempty"`
	// DuplicateWindow is how long a Nats-Msg-Id is remembered. Default 10m
	// (the dispatcher's default lease plus backoff cap fits in it).
	DuplicateWindow transport.Duration `json:"duplicate_window,omitempty"`
}

var (
	natsStreamRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,255}$`)
	natsHeaderRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,128}$`)
)

func (n *NATS) prepare(at string) []error {
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if n.MsgID == "" {
		n.MsgID = "{event_id}"
	}
	var err error
	if n.Subject == "" {
		add("%s.subject: required, e.g. \"{event_type}\"", at)
	} else if n.subject, err = parseTemplate(n.Subject); err != nil {
		add("%s.subject: %v", at, err)
	}
	if n.msgID, err = parseTemplate(n.MsgID); err != nil {
		add("%s.msg_id: %v", at, err)
	}
	var herrs []error
	n.headers, herrs = compileHeaders(n.Headers, at+".headers", natsHeaderRE, func(h string) bool {
		return strings.HasPrefix(strings.ToLower(h), "nats-")
	})
	errs = append(errs, herrs...)
	s := &n.Stream
	if !natsStreamRE.MatchString(s.Name) {
		add("%s.stream.name %q: 1-255 letters, digits, '-' or '_'", at, s.Name)
	}
	if len(s.Subjects) == 0 {
		add("%s.stream.subjects: at least one subject the events are published on", at)
	}
	for i, sub := range s.Subjects {
		if !ValidNATSSubject(sub, true) {
			add("%s.stream.subjects[%d] %q: not a subject (dot-separated tokens, * or > as a whole token)", at, i, sub)
		}
	}
	if s.Storage == "" {
		s.Storage = "file"
	}
	if s.Storage != "file" && s.Storage != "memory" {
		add("%s.stream.storage %q: file or memory", at, s.Storage)
	}
	if s.Retention == "" {
		s.Retention = "limits"
	}
	if s.Retention != "limits" && s.Retention != "interest" && s.Retention != "workqueue" {
		add("%s.stream.retention %q: limits, interest or workqueue", at, s.Retention)
	}
	if s.Replicas == 0 {
		s.Replicas = 1
	}
	if s.Replicas < 1 || s.Replicas > 5 {
		add("%s.stream.replicas %d: 1-5", at, s.Replicas)
	}
	if s.DuplicateWindow == 0 {
		s.DuplicateWindow = transport.Duration(10 * time.Minute)
	}
	if s.MaxAge < 0 || s.DuplicateWindow < 0 || (s.MaxAge > 0 && s.DuplicateWindow > s.MaxAge) {
		add("%s.stream: max_age and duplicate_window must not be negative, and duplicate_window not above max_age", at)
	}
	return errs
}

// ValidNATSSubject reports whether s is a subject (wildcards allowed when
// pattern): non-empty dot-separated tokens without whitespace, with * and
// > only as whole tokens and > only last.
func ValidNATSSubject(s string, pattern bool) bool {
	if s == "" {
		return false
	}
	toks := strings.Split(s, ".")
	for i, t := range toks {
		if t == "" || strings.ContainsAny(t, " \t\r\n") {
			return false
		}
		if strings.ContainsAny(t, "*>") {
			if !pattern || (t != "*" && t != ">") || (t == ">" && i != len(toks)-1) {
				return false
			}
		}
	}
	return true
}
