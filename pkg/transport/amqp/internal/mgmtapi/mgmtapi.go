// Package mgmtapi is a minimal client of the RabbitMQ management HTTP API:
// JSON requests with basic auth. The transport's policy setter and the
// tests' vhost and user helpers (amqptest) share it.
package mgmtapi

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// Client calls the API at Base as User.
type Client struct {
	base       url.URL
	user, pass string
	http       *http.Client
}

// New returns a client of the API at base (http(s)://host[:port]) whose
// requests time out after timeout.
func New(base url.URL, user, pass string, timeout time.Duration) *Client {
	return &Client{base: base, user: user, pass: pass, http: &http.Client{Timeout: timeout}}
}

// Host is the API's host:port.
func (c *Client) Host() string { return c.base.Host }

// Do sends body (if not nil) as JSON to path (escaped; it may carry a
// query) and decodes the answer into out (if not nil). A status other than
// 2xx is an error carrying the status and the start of the answer; no
// error carries the credentials (they are not in the URL).
func (c *Client) Do(ctx context.Context, method, path string, body, out any) error {
	u := c.base
	path, u.RawQuery, _ = strings.Cut(path, "?")
	u.RawPath = path
	u.Path, _ = url.PathUnescape(path)
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return fmt.Errorf("%s %s: %w", method, u.Path, err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), rd)
	if err != nil {
		return err
	}
	req.SetBasicAuth(c.user, c.pass)
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("%s %s: %w", method, u.Path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode/100 != 2 {
		if len(b) > 300 {
			b = b[:300]
		}
		return fmt.Errorf("%s %s: %s %s", method, u.Path, resp.Status, bytes.TrimSpace(b))
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}
