'use strict';
/**
 * The recording example's browser step: opens one page of the granted workload endpoint in
 * headless Chromium through Playwright and keeps a screenshot and what the page's DOM says.
 *
 *   node screenshot.js URL PNG_PATH JSON_PATH
 *
 * Playwright talks to Chromium over pipes (its default launch), never a TCP debugging port. The
 * browser addresses only URL's origin: every other request is aborted (and listed), no other
 * host name resolves, and Chromium's background networking is off. Exit status 0 only when the
 * page loaded and both files were written. The page is workload data: its facts are recorded,
 * never acted on.
 */
const fs = require('fs');
const { chromium } = require('playwright-core');

const CHROMIUM_PATH = '/usr/bin/chromium';
const VIEWPORT = { width: 1024, height: 640 };
const STEP_TIMEOUT_MS = 30000;
const BANNER_SELECTOR = '#banner';
const MARKER_SELECTOR = '#marker';

function chromiumArgs(hostname) {
  return [
    // The container is the sandbox: no user namespaces in it, every capability dropped.
    '--no-sandbox',
    // Docker's /dev/shm is 64 MiB; Chromium keeps its shared memory in /tmp instead.
    '--disable-dev-shm-usage',
    // Nothing but the page: no updates, sync, field trials, crash uploads, pings or prefetch.
    '--disable-background-networking', '--disable-component-update', '--disable-sync',
    '--disable-default-apps', '--disable-extensions', '--disable-breakpad',
    '--disable-domain-reliability', '--disable-field-trial-config', '--no-pings',
    '--no-first-run', '--no-default-browser-check', '--dns-prefetch-disable',
    `--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE ${hostname}`,
  ];
}

/** An exited process not yet reaped: it has released every descriptor. */
function isZombie(pid) {
  try {
    const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2).startsWith('Z');
  } catch {
    return true; // reaped meanwhile
  }
}

/**
 * The TCP listening sockets held by any process of this container, read from /proc while the
 * browser runs: Playwright's pipe leaves none. (Sockets no process here holds, such as Docker's
 * embedded DNS resolver, are not the browser's.) Processes whose descriptors cannot be read are
 * counted, so an empty list proves something.
 */
function tcpListeners() {
  const listening = new Map(); // socket inode -> local address, hex as in /proc
  for (const table of ['/proc/net/tcp', '/proc/net/tcp6']) {
    let text;
    try {
      text = fs.readFileSync(table, 'utf8');
    } catch {
      continue; // no IPv6 in this namespace
    }
    for (const line of text.trim().split('\n').slice(1)) {
      const fields = line.trim().split(/\s+/);
      if (fields[3] === '0A') listening.set(fields[9], fields[1]);
    }
  }
  const held = [];
  let unreadable = 0;
  for (const pid of fs.readdirSync('/proc').filter((name) => /^[0-9]+$/.test(name))) {
    let descriptors;
    try {
      descriptors = fs.readdirSync(`/proc/${pid}/fd`);
    } catch (error) {
      if (error.code !== 'ENOENT' && !isZombie(pid)) unreadable += 1; // neither holds sockets
      continue;
    }
    for (const fd of descriptors) {
      let target;
      try {
        target = fs.readlinkSync(`/proc/${pid}/fd/${fd}`);
      } catch {
        continue; // closed meanwhile
      }
      const inode = /^socket:\[([0-9]+)\]$/.exec(target);
      if (inode && listening.has(inode[1])) {
        held.push({ pid: Number(pid), local_address: listening.get(inode[1]) });
      }
    }
  }
  return { held, processes_unreadable: unreadable };
}

async function main(argv) {
  if (argv.length !== 3) {
    console.error('usage: node screenshot.js URL PNG_PATH JSON_PATH');
    return 2;
  }
  const [url, pngPath, jsonPath] = argv;
  const { origin, hostname } = new URL(url);
  const requests = [];
  const blocked = [];
  const browser = await chromium.launch({
    executablePath: CHROMIUM_PATH, args: chromiumArgs(hostname), timeout: STEP_TIMEOUT_MS,
  });
  try {
    const context = await browser.newContext({
      viewport: VIEWPORT, deviceScaleFactor: 1, serviceWorkers: 'block',
    });
    context.setDefaultTimeout(STEP_TIMEOUT_MS);
    await context.route('**/*', (route) => {
      const requestUrl = route.request().url();
      if (new URL(requestUrl).origin === origin) {
        requests.push(requestUrl);
        return route.continue();
      }
      blocked.push(requestUrl);
      return route.abort('blockedbyclient');
    });
    const page = await context.newPage();
    const response = await page.goto(url, { waitUntil: 'load' });
    const marker = page.locator(MARKER_SELECTOR);
    const facts = {
      url,
      final_url: page.url(),
      http_status: response ? response.status() : null,
      title: await page.title(),
      body_text: await page.locator('body').innerText(),
      marker_text: await marker.innerText(),
      marker_visible: await marker.isVisible(),
      boxes: {
        banner: await page.locator(BANNER_SELECTOR).boundingBox(),
        marker: await marker.boundingBox(),
      },
      viewport: VIEWPORT,
      tcp_listeners: tcpListeners(),
      browser_version: browser.version(),
      playwright_core_version: require('playwright-core/package.json').version,
    };
    await page.screenshot({ path: pngPath });
    facts.requests = requests;
    facts.blocked_requests = blocked;
    fs.writeFileSync(jsonPath, JSON.stringify(facts, null, 2) + '\n');
  } finally {
    await browser.close();
  }
  return 0;
}

main(process.argv.slice(2)).then(
  (code) => { process.exitCode = code; },
  (error) => {
    console.error(`screenshot.js: ${error.message}`);
    process.exitCode = 1;
  });
